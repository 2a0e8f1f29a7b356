"""``iter_full_parameters``: a sharded model's weights, one full tensor at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch.dynamo import uncompiled
from ..frontend.loading import resting_states
from .gather import GatheredBucket
from .plan import Entry, full_of_tensor, plan


def iter_full_parameters(
    model: nn.Module,
    *,
    lora: str = "merged",
    dtype: torch.dtype | None = None,
    bucket_mb: float = 0.0,
    rank0_only: bool = False,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(name, full tensor)`` for every weight of a sharded model, gathering a few at a
    time: what a rollout engine (vLLM, SGLang) loads after each training step.

    Names are the keys of the unsharded model's ``state_dict()`` (tied parameters under each of
    their names, gathered once per name; persistent buffers too). For a peft model, ``lora``:

    - ``"merged"`` (default): ``merge_and_unload()``'s names and values (LoRA deltas added to a
      gathered copy of each base weight; the model is not changed);
    - ``"base"``: the same names, base weights without the adapters;
    - ``"adapter"``: only the adapter weights, under the names of peft's adapter file.

    It is collective: every rank of the model's mesh iterates the whole generator, in step.
    ``rank0_only=True``: the other ranks get ``(name, None)`` (they still take part in every
    gather); else every rank gets every tensor (verl's rollout engines on each rank; TRL's
    vLLM client on rank 0 only: ``rank0_only=True``). ``dtype`` casts floating-point weights
    (before the gather: bf16 halves the bytes sent); merged weights are computed in their own
    dtype, then cast. ``device`` moves each tensor there (e.g. ``"cpu"``).

    Memory: the shards, plus the tensor being handed out, plus what the caller still holds. With
    ``bucket_mb=0`` each tensor is its own all-gather, handed out as gathered (a view of the
    collective's buffer, no copy); a larger ``bucket_mb`` gathers consecutive tensors up to that
    size in one collective (fewer, larger messages), holds that bucket until its last tensor is
    handed out and copies each tensor out of it. Every tensor handed out is memory of its own
    that the export never writes or reuses afterwards: a consumer may keep it (what it keeps
    adds to the memory above) or change it in place. Do not train while iterating.

    ```python
    from zero3_compile.rollout import iter_full_parameters

    for name, tensor in iter_full_parameters(model, dtype=torch.bfloat16):
        llm_weights[name].copy_(tensor)  # every rank, in the same order
    ```
    """
    model = uncompiled(model)  # a torch.compile'd model: its module
    resting_states(
        model, "iter_full_parameters()", "turn gradient sync back on and leave z3.gathered() first"
    )
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    limit = bucket_mb * 2**20
    for bucket in _buckets(plan(model, lora), dtype, limit):
        sharded = [e for e in bucket if e.state is not None]
        dtypes = [None if e.merge is not None else dtype for e in sharded]
        gathered = GatheredBucket([e.state for e in sharded], dtypes) if sharded else None
        for item in bucket:
            if item.state is not None:
                full = gathered.full(sharded.index(item))
                if item.merge is not None:
                    full = item.merge.apply(full)
            else:
                full = full_of_tensor(item.tensor)
            if dtype is not None and full.is_floating_point() and full.dtype != dtype:
                full = full.to(dtype)
            if not keep:
                del full
                yield item.name, None
                continue
            if device is not None:
                full = full.to(device)
            yield item.name, full
            del full  # before the next gather: the caller may have dropped its reference
        del gathered


def _buckets(entries: list[Entry], dtype: torch.dtype | None, limit: float) -> list[list[Entry]]:
    """Consecutive entries whose gathered bytes stay within ``limit`` (at least one each)."""
    buckets: list[list[Entry]] = [[]]
    size = 0
    for item in entries:
        if item.state is not None:
            nbytes = _gathered_bytes(item, dtype)
            if buckets[-1] and any(e.state is not None for e in buckets[-1]):
                if size + nbytes > limit:
                    buckets.append([])
                    size = 0
            size += nbytes
        buckets[-1].append(item)
    return [b for b in buckets if b]


def _gathered_bytes(item: Entry, dtype: torch.dtype | None) -> int:
    spec = item.state.spec
    own = item.state.local().dtype
    wire = dtype if dtype is not None and own.is_floating_point and item.merge is None else own
    element = torch.empty((), dtype=wire).element_size()
    return spec.padded_numel * spec.world_size * element
