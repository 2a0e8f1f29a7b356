"""Blockwise quantization for compressed collectives (ZeRO++'s qwZ and qgZ), as plain tensor
functions: run eagerly on real tensors and traced into the scheduled graphs alike.

A flat tensor of ``numel`` elements is cut into blocks of ``block`` elements (the tail block
padded with zeros); each block is scaled by its largest magnitude into the symmetric integer
range of ``bits`` (int8: -127..127, int4: -7..7) and rounded to nearest, so an element's error is
at most half a step: ``amax(block) / (2 * levels)``; or, for gradients, stochastically (up with
the probability of the fraction, the draw a hash of the element's position and bits): unbiased,
reproducible, at most one step off. The payload that travels is one ``uint8``
tensor, the integers (int4: two per byte, low nibble first) followed by the float32 scales'
bytes, so a compressed all-gather or all-to-all is still one collective::

    payload = [ q_0 q_1 ... q_{n-1} | scale_0 ... scale_{n/block-1} ]     # uint8
    n = padded numel (a multiple of block; block a multiple of 8, so the scales and every row
    of a (rows, payload) tensor start 4-byte aligned)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LEVELS = {8: 127, 4: 7}
BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Quantization:
    """How a collective's payload is compressed: integers of ``bits`` and one float32 scale per
    ``block`` elements."""

    bits: int
    block: int

    @classmethod
    def of(cls, name: str | None, block: int) -> Quantization | None:
        return None if name is None else cls(BITS[name], block)


def aligned_numel(segments: Sequence[int], block: int) -> int:
    """Elements of a row whose ``segments`` (consecutive lengths) each start a new block: each
    rounded up to whole blocks (``align_rows``)."""
    return sum(padded_numel(s, block) for s in segments)


def align_rows(rows: torch.Tensor, segments: Sequence[int], block: int) -> torch.Tensor:
    """``rows`` (``(n, sum(segments))``) with each segment padded with zeros to whole blocks, so
    no block spans two segments (two parameters' shards: a block's scale is then never set by
    another parameter's larger values). Rows whose segments are whole blocks come back as they
    are."""
    pads = [padded_numel(s, block) - s for s in segments]
    if not any(pads):
        return rows
    parts = rows.split(list(segments), dim=1)
    return torch.cat([F.pad(part, (0, pad)) for part, pad in zip(parts, pads)], dim=1)


def unalign_rows(rows: torch.Tensor, segments: Sequence[int], block: int) -> torch.Tensor:
    """``align_rows``'s inverse: ``(n, aligned_numel)`` -> ``(n, sum(segments))``."""
    padded = [padded_numel(s, block) for s in segments]
    if padded == list(segments):
        return rows
    parts = rows.split(padded, dim=1)
    return torch.cat([part[:, :s] for part, s in zip(parts, segments)], dim=1)


def padded_numel(numel: int, block: int) -> int:
    """``numel`` rounded up to whole blocks."""
    return -(-numel // block) * block


def payload_bytes(numel: int, block: int, bits: int) -> int:
    """Bytes of the payload of a flat tensor of ``numel`` elements."""
    padded = padded_numel(numel, block)
    return padded * bits // 8 + (padded // block) * 4


def numel_of_payload(payload: int, block: int, bits: int) -> int:
    """The padded numel a payload of ``payload`` bytes holds (``payload_bytes``'s inverse)."""
    padded, rest = divmod(payload * 8 * block, bits * block + 32)
    assert not rest, (payload, block, bits)
    return padded


def quantize_rows(
    rows: torch.Tensor, block: int, bits: int, stochastic: bool = False
) -> torch.Tensor:
    """Each row of ``rows`` (``(n_rows, numel)``, floating) as its payload:
    ``(n_rows, payload_bytes)`` ``uint8``. ``stochastic``: round up with probability equal to
    the fraction (unbiased, error below one step) instead of to nearest (half a step)."""
    levels = LEVELS[bits]
    n_rows, numel = rows.shape
    padded = padded_numel(numel, block)
    x = rows.to(torch.float32)
    if padded != numel:
        x = F.pad(x, (0, padded - numel))
    blocks = x.view(n_rows, -1, block)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    scaled = blocks / scale
    if stochastic:
        rounded = torch.floor(scaled + _uniform(x).view_as(scaled))
    else:
        rounded = torch.round(scaled)
    q = torch.clamp(rounded, -levels, levels).to(torch.int8)
    q = q.view(n_rows, padded)
    if bits == 4:
        nibbles = (q + 8).to(torch.uint8).view(n_rows, -1, 2)  # 1..15, two per byte
        ints = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    else:
        ints = q.view(torch.uint8)
    return torch.cat([ints, scale.view(n_rows, -1).view(torch.uint8)], dim=1)


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """A draw in [0, 1) per element of ``x`` (float32, contiguous) from a hash of its position
    and its bits: reproducible (every rank and every run rounds a value alike, no generator
    state), and as good as independent of the value's rounding fraction."""
    mask = 0xFFFFFFFF
    position = torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    h = (position * 2654435761 + (x.view(torch.int32).to(torch.int64) & mask)) & mask
    for _ in range(2):  # a 32-bit integer finaliser (xor-shift-multiply)
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & mask
    h = h ^ (h >> 16)
    return (h & 0xFFFFFF).to(torch.float32) / float(1 << 24)


def quantize(flat: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """``flat`` (1-D, floating) as its payload (1-D ``uint8``, ``payload_bytes`` long)."""
    return quantize_rows(flat.view(1, -1), block, bits).view(-1)


def dequantize(
    payload: torch.Tensor, numel: int, block: int, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``numel`` values a ``quantize`` payload holds, in ``dtype``."""
    return dequantize_rows(payload.view(1, -1), numel, block, bits, dtype).view(-1)


def dequantize_rows(
    payloads: torch.Tensor, numel: int, block: int, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows of payloads (``(n_rows, payload_bytes)``) as ``(n_rows, numel)`` values."""
    n_rows = payloads.shape[0]
    padded = padded_numel(numel, block)
    int_bytes = padded * bits // 8
    ints, scale_bytes = payloads[:, :int_bytes], payloads[:, int_bytes:]
    if bits == 4:
        low = (ints & 15).to(torch.int8) - 8
        high = (ints >> 4).to(torch.int8) - 8
        q = torch.stack([low, high], dim=2).reshape(n_rows, padded)
    else:
        q = ints.contiguous().view(torch.int8)
    scale = scale_bytes.contiguous().view(torch.float32).view(n_rows, -1, 1)
    values = (q.to(torch.float32).view(n_rows, -1, block) * scale).view(n_rows, padded)
    return values[:, :numel].to(dtype).contiguous()


def round_trip(rows: torch.Tensor, segments: Sequence[int], how: Quantization) -> torch.Tensor:
    """``rows`` (``(n, sum(segments))``) as their receiver gets them back in float32: aligned
    (each segment starts a block), quantized to nearest, dequantized, unaligned."""
    aligned = align_rows(rows, segments, how.block)
    payload = quantize_rows(aligned, how.block, how.bits)
    back = dequantize_rows(payload, aligned.shape[1], how.block, how.bits, torch.float32)
    return unalign_rows(back, segments, how.block)
