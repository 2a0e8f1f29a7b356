"""Copy-in and copy-out as four fixed operations: what the lowering passes put around a bucket's
collective by default, so Inductor calls them instead of generating (and, on CPU, compiling) a
kernel for every bucket's shapes. Their bodies are ``arithmetic.py``'s functions."""

from __future__ import annotations

import torch

from . import arithmetic, quantize


@torch.library.custom_op("zero3::gather_copy_in", mutates_args=())
def gather_copy_in(
    shards: list[torch.Tensor], sizes: list[int], dtype: torch.dtype
) -> torch.Tensor:
    return arithmetic.gather_copy_in_direct(shards, sizes, dtype)


@gather_copy_in.register_fake
def _gather_copy_in_fake(shards, sizes, dtype):
    return shards[0].new_empty(sum(sizes), dtype=dtype)


@torch.library.custom_op("zero3::gather_copy_out", mutates_args=())
def gather_copy_out(gathered: torch.Tensor, world: int, sizes: list[int]) -> list[torch.Tensor]:
    return arithmetic.gather_copy_out_parts(gathered, world, sizes)


@gather_copy_out.register_fake
def _gather_copy_out_fake(gathered, world, sizes):
    return [gathered.new_empty((world, size)) for size in sizes]


@torch.library.custom_op("zero3::reduce_copy_in", mutates_args=())
def reduce_copy_in(
    grads: list[torch.Tensor], world: int, sizes: list[int], dtype: torch.dtype
) -> torch.Tensor:
    return arithmetic.reduce_copy_in_direct(grads, world, sizes, dtype)


@reduce_copy_in.register_fake
def _reduce_copy_in_fake(grads, world, sizes, dtype):
    return grads[0].new_empty(world * sum(sizes), dtype=dtype)


@torch.library.custom_op("zero3::reduce_copy_out", mutates_args=())
def reduce_copy_out(
    reduced: torch.Tensor, sizes: list[int], numels: list[int], divisor: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    return arithmetic.reduce_copy_out_direct(reduced, sizes, numels, divisor, [dtype] * len(sizes))


@reduce_copy_out.register_fake
def _reduce_copy_out_fake(reduced, sizes, numels, divisor, dtype):
    return [reduced.new_empty(numel, dtype=dtype) for numel in numels]


@torch.library.custom_op("zero3::secondary_slice", mutates_args=())
def secondary_slice(full: torch.Tensor, numel: int, index: int) -> torch.Tensor:
    return arithmetic.secondary_slice(full, numel, index)


@secondary_slice.register_fake
def _secondary_slice_fake(full, numel, index):
    return full.new_empty(numel)


GATHER_COPY_IN = torch.ops.zero3.gather_copy_in.default
GATHER_COPY_OUT = torch.ops.zero3.gather_copy_out.default
REDUCE_COPY_IN = torch.ops.zero3.reduce_copy_in.default
REDUCE_COPY_OUT = torch.ops.zero3.reduce_copy_out.default
SECONDARY_SLICE = torch.ops.zero3.secondary_slice.default


# Quantization (compressed collectives, ``quantize.py``): fixed operations in every graph, fused
# or not; Inductor's CPU code for a bitcast of the scales' bytes next to a bf16 cast was seen to
# give NaNs (torch 2.13), and the eager body is the one the tests check.
@torch.library.custom_op("zero3::quantize_rows", mutates_args=())
def quantize_rows(rows: torch.Tensor, block: int, bits: int, stochastic: bool) -> torch.Tensor:
    return quantize.quantize_rows(rows, block, bits, stochastic)


@quantize_rows.register_fake
def _quantize_rows_fake(rows, block, bits, stochastic):
    size = quantize.payload_bytes(rows.shape[1], block, bits)
    return rows.new_empty((rows.shape[0], size), dtype=torch.uint8)


@torch.library.custom_op("zero3::dequantize_rows", mutates_args=())
def dequantize_rows(
    payloads: torch.Tensor, numel: int, block: int, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    return quantize.dequantize_rows(payloads, numel, block, bits, dtype)


@dequantize_rows.register_fake
def _dequantize_rows_fake(payloads, numel, block, bits, dtype):
    return payloads.new_empty((payloads.shape[0], numel), dtype=dtype)


QUANTIZE_ROWS = torch.ops.zero3.quantize_rows.default
DEQUANTIZE_ROWS = torch.ops.zero3.dequantize_rows.default
