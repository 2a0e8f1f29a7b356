"""Exact gathers of a few sharded parameters at a time, for exporting weights.

``GatheredBucket(states, dtypes)`` all-gathers the shards of ``states`` with one collective per
scheme (the eager scheme the model's getters use, after the same cross-rank check), in the
parameters' own dtype (fp32 master weights stay fp32) or cast to ``dtype`` before the collective
(half the bytes on the wire for bf16). On gloo the gather is written in place instead (each
rank's slot broadcast from it: ``_gather_by_broadcasts``), since gloo's all-gather holds the
gathered bytes twice. ``full(i)`` then gives member ``i``'s full tensor: a view of the gathered
buffer for a bucket of one, else a copy of its rows made when asked, so a bucket holds its
gathered buffer plus the one member being handed out, never every member twice. A buffer is
never written again once its tensors are handed out: the caller may keep them.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import torch
import torch.distributed as dist

from .._torch.c10d import backend_of, resolve_group
from ..collectives import arithmetic
from ..collectives.schemes import EAGER, AllGather, gather_scheme, run_gather
from ..offload.params import readable
from ..runtime import guard
from ..runtime.root import check_eager
from ..sharding.state import ShardedParam


class GatheredBucket:
    """The full tensors of ``states`` (every rank of their mesh must build the same buckets in
    the same order: the gathers are collectives)."""

    def __init__(self, states: list[ShardedParam], dtypes: list[torch.dtype | None] | None = None):
        self.states = states
        dtypes = dtypes or [None] * len(states)
        self.specs = [
            replace(s.spec, param_dtype=_wire_dtype(s.local().dtype, d))
            for s, d in zip(states, dtypes)
        ]
        self._fulls: list[torch.Tensor | None] = [None] * len(states)
        self._flat: dict[int, tuple[torch.Tensor, list[int]]] = {}  # member -> (buffer, group)
        with torch.no_grad():
            for group in _groups(states, self.specs):
                self._issue(group)

    def _issue(self, group: list[int]) -> None:
        states = [self.states[i] for i in group]
        specs = [self.specs[i] for i in group]
        shards = [readable(s.local()) for s in states]  # an offloaded shard: read from its store
        scheme = gather_scheme(specs[0], states[0].local().dtype)
        with states[0].root.active():
            if scheme.communicates:
                code = zlib.crc32(repr([s.param_id for s in states]).encode()) & 0x7FFFFFFF
                label = f"of {len(states)} parameters for export ({states[0].fqn!r}, ...)"
                check_eager(specs[0], guard.KIND_EAGER_GATHER, code, label)
            if type(scheme) is AllGather and backend_of(scheme.group) == "gloo":
                gathered = _gather_by_broadcasts(shards, specs, scheme)
            elif len(group) == 1 or not isinstance(scheme, AllGather):
                for i, full in zip(group, run_gather(scheme, EAGER, shards, specs)):
                    self._fulls[i] = full
                return
            else:  # one collective, the members' rows copied out one at a time when asked
                payloads = scheme.copy_in(EAGER, shards, specs)
                (gathered,) = scheme.wait(EAGER, scheme.issue(EAGER, payloads))
        if len(group) == 1:  # the buffer is the parameter (padding at its tail): a view of it
            self._fulls[group[0]] = arithmetic.gathered_rows(gathered, specs[0])
            return
        for i in group:
            self._flat[i] = (gathered, group)

    def full(self, i: int) -> torch.Tensor:
        """Member ``i``'s full tensor, a tensor of its own (never a view of a shard); the bucket
        lets go of it."""
        full = self._fulls[i]
        if full is None:
            gathered, group = self._flat.pop(i)
            full = _copy_out(gathered, [self.specs[j] for j in group], group.index(i))
        self._fulls[i] = None
        shard = self.states[i].local()
        if full.numel() and full.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
            full = full.clone()  # one rank: the shard itself, uncast
        return full


def _gather_by_broadcasts(shards, specs, scheme: AllGather) -> torch.Tensor:
    """The gathered bucket ``(N * bucket_numel,)`` written in place: this rank's shards cast into
    its own slot, then each rank's slot broadcast from it. gloo's all-gather receives into a
    buffer of its own and copies that into the output, so it holds the gathered bytes twice
    (and the copy-in a third part); this holds them once. Same bytes on the wire, N collectives."""
    group = resolve_group(scheme.group)
    world, rank = scheme.world_size, group.rank()
    sizes = arithmetic.sizes(specs)
    gathered = torch.empty(world * sum(sizes), dtype=scheme.dtype, device=shards[0].device)
    slots = gathered.view(world, sum(sizes))  # (N, bucket_numel)
    offset = 0
    for shard, size in zip(shards, sizes):
        part = slots[rank].narrow(0, offset, size)
        part[: shard.numel()].copy_(shard.reshape(-1))
        part[shard.numel() :].zero_()
        offset += size
    for source in range(world):
        dist.broadcast(slots[source], src=dist.get_global_rank(group, source), group=group)
    return gathered


def _wire_dtype(shard_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a shard is gathered in: its own, or ``dtype`` for floating-point shards."""
    if dtype is None or not shard_dtype.is_floating_point:
        return None
    return dtype


def _groups(states: list[ShardedParam], specs) -> list[list[int]]:
    """Members that can share a collective: same runtime and same scheme."""
    found: dict[tuple, list[int]] = {}
    for i, (state, spec) in enumerate(zip(states, specs)):
        key = (id(state.root), gather_scheme(spec, state.local().dtype).key())
        found.setdefault(key, []).append(i)
    return list(found.values())


def _copy_out(gathered: torch.Tensor, specs, index: int) -> torch.Tensor:
    """Member ``index``'s full tensor out of a gathered bucket of several (N * bucket_numel,):
    its padded rows of every rank, copied, viewed as the parameter (first ``dim0`` rows)."""
    sizes = arithmetic.sizes(specs)
    per_rank = gathered.view(specs[0].world_size, sum(sizes))
    part = per_rank.narrow(1, sum(sizes[:index]), sizes[index])
    part = part.clone(memory_format=torch.contiguous_format)
    return arithmetic.gathered_rows(part, specs[index])
