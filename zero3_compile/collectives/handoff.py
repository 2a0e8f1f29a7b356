"""Prefetch across compiled graphs: the next graph's first all-gather issued in this one's tail.

Inside one graph the prefetch pass issues bucket ``i + 1`` while bucket ``i`` computes; the
first bucket of a graph has nothing before it to hide behind. When a model is compiled block by
block (``for b in blocks: b.compile(backend="zero3")``, FSDP2's habit) every block is its own
graph, and without this every block's first gather (for small blocks: its only one) is exposed,
in forward and in backward.

A graph's first bucket is issued by ``zero3::take_gather`` and, after its last gather finished,
the graph calls ``zero3::handoff_gather``. The runtime learns, per call site (the storages of
the first bucket's shards), which take followed that site's handoff last time; at the handoff it
issues that successor's copy-in and all-gather now, while this graph's tail computes. The
handoff's output is waited inside this graph (before its next collective, else at its end), so
no collective is ever in flight across a graph boundary: the eager code between graphs, the next
graph's cross-rank check and gloo's one-collective-in-flight rule see nothing pending. The next
graph's take then finds the gathered buffer ready.

Safety: a prefetched buffer is used only if the take asks for exactly the same shards (storage,
offset, shape, spec, dtype) and none of them was written since it was copied in (the shards'
version counters; an optimizer step writes them in place). Anything else discards it and
gathers afresh. Successors are followed only within one kind of graph (forward to forward,
backward to backward), never across an optimizer step. Every rank runs the same sequence of
graphs (the cross-rank check makes sure), so every rank learns the same successors and issues
the same prefetches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .._torch.c10d import WAIT, register_wait
from .._torch.tensors import storage_key, version
from ..sharding.spec import ShardSpec
from .schemes import EAGER, gather_scheme


@dataclass
class _Site:
    """A take: which shards, how they are gathered, in which kind of graph."""

    key: tuple
    kind: int
    shards: tuple[torch.Tensor, ...]  # the shards as the take read them (views of storage)
    specs: tuple[str, ...]
    dtype: torch.dtype


@dataclass
class _Pending:
    key: tuple
    out: torch.Tensor  # the all-gather's output (waited by the handoff's wait)
    versions: tuple[int, ...]  # of the shards it copied in


def _key(shards, specs, dtype) -> tuple:
    return (
        tuple(
            (storage_key(s), s.storage_offset(), tuple(s.size()), tuple(s.stride())) for s in shards
        ),
        tuple(specs),
        dtype,
    )


def _issue(shards, specs, dtype) -> torch.Tensor:
    """The bucket's copy-in and all-gather, now (``schemes.AllGather``, eagerly)."""
    parsed = [ShardSpec.parse(s) for s in specs]
    scheme = gather_scheme(parsed[0], dtype)
    with torch.no_grad():
        (out,) = scheme.issue(EAGER, scheme.copy_in(EAGER, list(shards), parsed))
    return out


# successors remembered at most: a site holds its shards' storage alive (views of it), so the
# sites of a model that is gone are forgotten once this many were learnt
MAX_SITES = 4096


class Handoff:
    """The process's cross-graph prefetch state (one per process: graphs run one at a time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.successors: dict[tuple, _Site] = {}  # (site key, kind) -> the take that followed
        self.current: dict[int, _Site] = {}  # kind -> the site of the graph running now
        self.after: tuple | None = None  # (site key, kind) of the last handoff, until a take
        self.pending: _Pending | None = None
        self.taken = 0  # takes served by a prefetch (tests and reports read it)
        self.discarded = 0  # prefetches nobody could use

    def take(self, shards, specs, dtype, kind: int) -> torch.Tensor:
        key = _key(shards, specs, dtype)
        with self.lock:
            site = _Site(key, kind, tuple(s.detach() for s in shards), tuple(specs), dtype)
            if self.after is not None and self.after[1] == kind:
                if len(self.successors) >= MAX_SITES and self.after not in self.successors:
                    self.successors.clear()  # models come and go: relearn rather than hold on
                self.successors[self.after] = site
            self.after = None
            self.current[kind] = site
            pending, self.pending = self.pending, None
        if pending is not None:
            WAIT(pending.out)  # waited in its graph already; a no-op then
            if pending.key == key and pending.versions == tuple(version(s) for s in shards):
                self.taken += 1
                return pending.out
            self.discarded += 1
        return _issue(shards, specs, dtype)

    def handoff(self, kind: int, like: torch.Tensor) -> torch.Tensor:
        """Issue the predicted next take of this kind; returns a tensor whose wait waits it."""
        with self.lock:
            site = self.current.get(kind)
            nxt = None
            if site is not None:
                self.after = (site.key, kind)
                nxt = self.successors.get(self.after)
        marker = like.new_empty(0)
        if nxt is None or self.pending is not None:
            return marker
        shards = nxt.shards
        out = _issue(shards, nxt.specs, nxt.dtype)
        self.pending = _Pending(nxt.key, out, tuple(version(s) for s in shards))
        register_wait(marker, lambda: WAIT(out))
        return marker

    def reset(self) -> None:
        """Forget everything learnt (a pending prefetch must have been waited)."""
        with self.lock:
            self.successors.clear()
            self.current.clear()
            self.after = None
            self.pending = None


HANDOFF = Handoff()
