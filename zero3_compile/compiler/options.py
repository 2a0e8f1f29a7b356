"""Backend options: ``torch.compile(model, backend="zero3", options={...})``."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

_CODEGENS = ("inductor", "eager")


def _number(value) -> bool:
    """A real, finite number (not a bool, not NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Options:
    """The backend's options: ``torch.compile(model, backend="zero3", options={...})``.

    ``options`` is a dict of these fields (or an ``Options``). An unknown key is an error that
    lists the valid ones, a wrong type or value an error naming the option;
    ``torch.compile(..., mode=...)`` is passed on to Inductor. Defaults are what was measured
    best on CPU (no GPU has been measured yet; ``bench/gpu.py`` is ready for one). The docs'
    options table is generated from this class.

    Example:
        ```python
        step_model = torch.compile(
            model, backend="zero3", options={"codegen": "eager", "bucket_mb": 25}
        )
        ```

    Attributes:
        codegen: "inductor" (default) or "eager" (run the scheduled FX graphs as they are:
            exact numerics, fast compiles, for debugging).
        bucket_mb: size cap of one all-gather / reduce-scatter bucket, in MiB of the
            communicated dtype. Parameters of one block are bucketed together up to this cap.
            5 measured best of 2/5/25/100 on a 25M-parameter GPT (bench/RESULTS.md): the same
            step time as 25, with one prefetched bucket less held (peak equal to FSDP2's).
        prefetch_depth: how many all-gathers may be issued ahead of the one being waited on
            (0: gather right before use, no overlap).
        max_inflight_bytes: optional cap on the bytes of gathers issued but not yet used; the
            first gather ahead is always allowed.
        reduce_scatter_depth: how many reduce-scatters may be in flight before the oldest is
            waited on (each one keeps its full-size gradient bucket alive).
        reload_depth: for offloaded parameters (``shard(offload=...)``), how many buckets ahead
            of the all-gather being prepared their shards' reads are issued (0: right before it).
        reshard_after_forward: False keeps the parameters gathered in forward alive for
            backward (ZeRO-2-like: more memory, one all-gather less per step; the memory
            budget's upper end).
        fused_copies: True splices the collectives' copy-in/copy-out into the graphs as ATen
            ops, which Inductor fuses into kernels specialised to each bucket's sizes: faster
            steps (about 6% on a 25M-parameter GPT on 2 CPU ranks), slower cold compiles (about
            1.8x; on CPU each kernel is a compiler run). False (default): four fixed operations
            (``zero3::gather_copy_in`` and the others) that Inductor calls as they are.
        serial_collectives: "auto" (default) waits each collective of a gloo process group
            before the next one is issued, so one is in flight at a time (compute still overlaps
            it): torch's gloo corrupts the heap with several in flight
            (``bench/repros/gloo_reduce_scatter_race.py``). True serializes every group's
            collectives, False none (gloo then is not safe).
        cross_graph_prefetch: True issues the next compiled graph's first all-gather in this
            graph's tail, as learnt from the previous step (``collectives/handoff.py``), used
            only if the next graph asks for exactly those shards, unwritten since: what a model
            compiled block by block (``block.compile``) needs to overlap its blocks' first
            gathers. Exact (bit-identical losses). Off by default while it is new.
        sync_timeout_s: how long a rank waits for the others at the cross-rank check before
            each compiled graph runs, before raising an error naming the missing ranks instead
            of hanging (default: the ``sync_timeout_s`` given to ``shard()``, 600 s).
        verify: check the scheduled graphs' invariants after every pass.
        dump_dir: write every graph before and after every pass, and the reports, here (also
            the ``ZERO3_DUMP_DIR`` environment variable).
        memory_budget_mb: per-rank memory a training step may use at its peak (persistent state
            included, see ``planner.py``); the planner keeps parameters gathered from forward to
            backward within it, saving their backward all-gathers. None: pure ZeRO-3. "auto"
            (CUDA): the device's free memory at compile time. A budget below the least a step
            needs is an error stating that least.
        optimizer_states: tensors of optimizer state per trainable parameter the budget accounts
            for (2 for Adam/AdamW, 1 for SGD with momentum, 0 when it is offloaded).
        weight_quantization: "int8" sends the forward's all-gathers as blockwise int8 and their
            float32 scales (ZeRO++'s qwZ: about a quarter of fp32's bytes, half of bf16's); the
            backward's re-gathers stay in full precision. None (default): off.
        gradient_quantization: "int8" or "int4" reduces gradients as blockwise-quantized rows
            exchanged with one all-to-all and summed in the reduction dtype by their owner, its
            own row exact (ZeRO++'s qgZ), instead of a reduce-scatter; with hybrid sharding
            within the row, then across the replicas as a quantized all-to-all of chunks and an
            all-gather of their quantized sums (the replicas' shards stay identical). A shard
            group across nodes (k ranks each: ``secondary_shard``'s count, else torchrun's
            ``LOCAL_WORLD_SIZE``) sums each bucket exactly within the node first, and only the
            nodes' sums of each rank's rows cross nodes, quantized: 1/k of the flat exchange's
            bytes between nodes, the rounding error about the flat one's. Rounding is stochastic
            (unbiased). Within 1% of the uncompressed held-out loss in every run measured (the
            band and the bytes: the docs' Benchmarks page). None (default): off.
        quantization_block: elements per float32 scale of both (a multiple of 8; default 256);
            each parameter's part of a bucket starts a new block.
        secondary_shard: "node" or a count of ranks (ZeRO++'s hpZ): the forward keeps, of each
            gathered parameter, this node's share of it (1/k of it on each of a node's k ranks,
            held until backward), and the backward re-gathers it from the node's ranks only,
            never across nodes. "node" takes k from torchrun's ``LOCAL_WORLD_SIZE``. Exact (the
            same values, bit for bit); with ``weight_quantization`` the kept values are the
            forward's dequantized ones. The memory budget and ``explain`` count the kept shares.
            None (default): off.
    """

    codegen: str = "inductor"
    bucket_mb: float = 5.0
    prefetch_depth: int = 1
    max_inflight_bytes: int | None = None
    reduce_scatter_depth: int = 1
    reload_depth: int = 1
    reshard_after_forward: bool = True
    fused_copies: bool = False
    serial_collectives: bool | str = "auto"
    cross_graph_prefetch: bool = False
    sync_timeout_s: float | None = None
    verify: bool = True
    dump_dir: str | None = None
    memory_budget_mb: float | str | None = None
    optimizer_states: int = 2
    weight_quantization: str | None = None
    gradient_quantization: str | None = None
    quantization_block: int = 256
    secondary_shard: str | int | None = None

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)

    @property
    def memory_budget_bytes(self) -> int | None:
        if self.memory_budget_mb is None:
            return None
        if self.memory_budget_mb == "auto":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "zero3: memory_budget_mb='auto' reads the free memory of a CUDA device; on "
                    "this machine give the budget in MiB"
                )
            # rounded down to 64 MiB: the compile caches key on the budget
            granule = 64 * 1024 * 1024
            return int(torch.cuda.mem_get_info()[0]) // granule * granule
        return int(float(self.memory_budget_mb) * 1024 * 1024)

    @classmethod
    def from_dict(cls, options: dict[str, Any] | Options | None) -> Options:
        if options is None:
            return cls()
        if isinstance(options, Options):
            return options
        if not isinstance(options, dict):
            raise TypeError(
                f"zero3: options must be a dict or zero3_compile.Options, got {type(options).__name__}"
            )
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"zero3: unknown option(s) {unknown}; valid options are: {', '.join(valid)}"
            )
        result = cls(**options)
        result.validate()
        return result

    def validate(self) -> None:
        if self.codegen not in _CODEGENS:
            raise ValueError(
                f"zero3: option codegen={self.codegen!r} is not one of {list(_CODEGENS)}"
            )
        if not (_number(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(
                f"zero3: option bucket_mb must be a positive number, got {self.bucket_mb!r}"
            )
        for name in ("prefetch_depth", "reduce_scatter_depth", "reload_depth"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"zero3: option {name} must be an int >= 0, got {value!r}")
        if self.reduce_scatter_depth < 1:
            raise ValueError("zero3: option reduce_scatter_depth must be >= 1")
        if self.max_inflight_bytes is not None and not (
            isinstance(self.max_inflight_bytes, int) and self.max_inflight_bytes > 0
        ):
            raise ValueError(
                f"zero3: option max_inflight_bytes must be a positive int or None, got {self.max_inflight_bytes!r}"
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError("zero3: option reshard_after_forward must be True or False")
        if not isinstance(self.fused_copies, bool):
            raise ValueError("zero3: option fused_copies must be True or False")
        if not (isinstance(self.serial_collectives, bool) or self.serial_collectives == "auto"):
            raise ValueError(
                "zero3: option serial_collectives must be 'auto', True or False, got "
                f"{self.serial_collectives!r}"
            )
        if not isinstance(self.cross_graph_prefetch, bool):
            raise ValueError("zero3: option cross_graph_prefetch must be True or False")
        if not isinstance(self.verify, bool):
            raise ValueError(f"zero3: option verify must be True or False, got {self.verify!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise ValueError(
                f"zero3: option dump_dir must be a folder path or None, got {self.dump_dir!r}"
            )
        budget = self.memory_budget_mb
        if budget is not None and budget != "auto" and not (_number(budget) and budget > 0):
            raise ValueError(
                f"zero3: option memory_budget_mb must be a positive number of MiB, 'auto' or "
                f"None, got {budget!r}"
            )
        if not (
            isinstance(self.optimizer_states, int)
            and not isinstance(self.optimizer_states, bool)
            and self.optimizer_states >= 0
        ):
            raise ValueError(
                f"zero3: option optimizer_states must be an int >= 0, got {self.optimizer_states!r}"
            )
        if self.weight_quantization not in (None, "int8"):
            raise ValueError(
                "zero3: option weight_quantization must be 'int8' or None, got "
                f"{self.weight_quantization!r}"
            )
        if self.gradient_quantization not in (None, "int8", "int4"):
            raise ValueError(
                "zero3: option gradient_quantization must be 'int8', 'int4' or None, got "
                f"{self.gradient_quantization!r}"
            )
        block = self.quantization_block
        if not (isinstance(block, int) and not isinstance(block, bool) and block > 0) or block % 8:
            raise ValueError(
                "zero3: option quantization_block must be a positive multiple of 8 (int4 packs "
                f"two per byte and each row's scales stay 4-byte aligned), got {block!r}"
            )
        node = self.secondary_shard
        if (
            node is not None
            and node != "node"
            and not (isinstance(node, int) and not isinstance(node, bool) and node >= 2)
        ):
            raise ValueError(
                "zero3: option secondary_shard must be 'node', a count of ranks per node >= 2, "
                f"or None, got {node!r}"
            )
        if self.sync_timeout_s is not None and not (
            _number(self.sync_timeout_s) and self.sync_timeout_s > 0
        ):
            raise ValueError("zero3: option sync_timeout_s must be a positive number of seconds")
