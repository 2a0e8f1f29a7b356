"""The cross-rank check that every rank is about to issue the same collectives.

Collectives only work when every rank issues the same ones in the same order; a rank that
does not (a rank-dependent branch, a mixture-of-experts loop that reads other experts' weights on
each rank, a graph that runs more often on one rank) hangs every rank or, when the sizes happen to
agree, silently mixes unrelated buffers. gloo even aborts the process when sizes differ.

So before each unit of collectives (a compiled graph's run, an eager gather or reduce-scatter),
every rank exchanges a small fixed-size record over a side channel: what it is about to do
(kind and a code: the digest of a graph's collective sequence, or a parameter's name and shape).
All records equal: go on. Otherwise every rank raises ``CollectiveMismatchError`` naming what each
rank was about to do, before any collective of the main group was issued. The check compares
what is issued, not how often each rank compiled: a rank that recompiles alone (another sequence
length) produces the same digest and passes.

The same exchange carries, for a backward graph, which of its outputs received a gradient on
each rank (``presence``): a parameter gets ``grad is None`` when no rank's loss reached it.

A rank that does not arrive within the timeout (it died, or it is stuck somewhere else) turns
into an error naming it on the others, instead of a hang.

The side channel of a data-parallel mesh (``SideChannel``) is a gloo communicator of the mesh's
ranks only, rendezvoused under a store prefix made of those ranks: sharding over one of several
disjoint groups (one per pipeline stage or tensor-parallel column) needs no other rank. The
channel is a resource shared by every model sharded over the same ranks (the ranks check in the
same order whichever model asks); what differs per model, the timeout, belongs to the model's
runtime (``Guard``), and compiled graphs carry theirs as a literal.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._torch.c10d import default_store, gloo_side_group, side_all_gather
from ..cluster import lost_ranks
from ..cluster import roll_call as roll_call  # re-exported: examples/train.py imports it here
from ..sharding.mesh import group_backend

log = logging.getLogger(__name__)

KIND_FORWARD = 1
KIND_BACKWARD = 2
KIND_INFERENCE = 3
KIND_EAGER_GATHER = 4
KIND_EAGER_REDUCE = 5
# the kind of each scheduled graph (``PassContext.graph_kind``)
GRAPH_KINDS = {
    "forward": KIND_FORWARD,
    "backward": KIND_BACKWARD,
    "inference": KIND_INFERENCE,
}
KIND_NAMES = {
    KIND_FORWARD: "forward graph",
    KIND_BACKWARD: "backward graph",
    KIND_INFERENCE: "inference graph",
    KIND_EAGER_GATHER: "eager all-gather",
    KIND_EAGER_REDUCE: "eager reduce-scatter",
}

_HEADER = 4  # magic, kind, code, sequence number
_PRESENCE_WORDS = 12
_BITS = 62  # presence bits per int64 word (clear of the sign bit)
MAX_PRESENCE = _PRESENCE_WORDS * _BITS
_WORDS = _HEADER + _PRESENCE_WORDS
_MAGIC = 0x2E803

DEFAULT_TIMEOUT_S = 600.0
_ROLL_CALL_S = 2.0  # how long a check that lost a peer waits for the others' roll call


class CollectiveMismatchError(RuntimeError):
    """The ranks were about to issue different collectives (raised on every rank).

    Example:
        ```python
        try:
            loss_fn(step_model(batch)).backward()
        except z3.CollectiveMismatchError as error:
            print(error)  # each rank's next collective, and the likely fix
        ```
    """

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#collectivemismatcherror)"


class SideChannel:
    """A gloo communicator over ``ranks`` (global ranks, sorted) and its running check count."""

    def __init__(self, ranks: list[int], timeout_s: float):
        self.ranks = list(ranks)
        self.name = "_".join(str(r) for r in self.ranks)
        self.me = self.ranks.index(dist.get_rank())
        self.group = gloo_side_group(f"zero3/side/{self.name}", self.ranks, timeout_s)
        self.count = 0
        self.lock = threading.Lock()

    def exchange(self, record: torch.Tensor, timeout_s: float) -> torch.Tensor:
        if self.group is None:
            raise RuntimeError("zero3: the process is exiting; its cross-rank check is closed")
        gathered = torch.empty(len(self.ranks) * _WORDS, dtype=torch.int64)
        side_all_gather(gathered, record, self.group, timeout_s)
        return gathered.view(len(self.ranks), _WORDS)


# (id of the default store, shard group name, replicate group name) -> the mesh's channel.
# A cache of communicators, like torch's own table of process groups; no timeouts in it.
_channels: dict[tuple, SideChannel] = {}
_by_ranks: dict[tuple, SideChannel] = {}

# How long the exit handler lets other gloo worker threads finish (see ``_close_at_exit``).
_EXIT_GRACE_S = 0.02


def _close_at_exit() -> None:
    """Shut the side channels down while the interpreter still runs, then let the process's
    other gloo workers settle.

    A gloo worker thread that drops the last reference to a tensor takes the GIL to free its
    Python object; if that happens once interpreter finalization has begun, taking the GIL ends
    the thread and the process aborts ("terminate called without an active exception"). Process
    groups kept alive past ``destroy_process_group`` (by a ``DeviceMesh``, by DTensor parameters
    of a model still referenced, or by these channels) still have running workers then; a
    standalone reproduction is ``bench/repros/gloo_exit_race.py``. Our own channels are shut
    down here (their workers joined); for the user's groups, which are not ours to destroy, a
    short wait with the GIL released lets a worker that is about to free a tensor do so while
    that is still safe (0 aborts in 50 amplified runs of the reproduction, against 9 to 44 in
    50 without it).
    """
    for channel in list(_by_ranks.values()):
        group, channel.group = channel.group, None
        shutdown = getattr(group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # best effort at exit: a peer may already be gone
                log.debug("zero3: shutting down side channel %s failed", channel.name)
    _channels.clear()
    _by_ranks.clear()
    time.sleep(_EXIT_GRACE_S)


_exit_registered = False


def _register_exit_handler() -> None:
    global _exit_registered
    if not _exit_registered:
        # Registered after torch's own handlers, so it runs before them (atexit is LIFO).
        atexit.register(_close_at_exit)
        _exit_registered = True


def _store_key() -> int:
    store = default_store()
    return id(store) if store is not None else 0


def open_channel(
    group_names: tuple[str, str], ranks: list[int], backend_group, timeout_s: float
) -> SideChannel | None:
    """The side channel of a data-parallel mesh (``ranks``), created once per process by every
    rank of the mesh at the same time (a collective call among them); None when no check is
    needed (one rank, or the ``fake`` process group)."""
    if len(ranks) <= 1 or group_backend(backend_group) == "fake":
        return None
    key = (_store_key(), *group_names)
    channel = _channels.get(key)
    if channel is None:
        by_ranks = (_store_key(), tuple(ranks))
        channel = _by_ranks.get(by_ranks)
        if channel is None:
            channel = SideChannel(ranks, timeout_s)
            _by_ranks[by_ranks] = channel
            _register_exit_handler()
        _channels[key] = channel
    return channel


def channel_of(group: str, replicate_group: str = "") -> SideChannel | None:
    return _channels.get((_store_key(), group, replicate_group))


@dataclass
class Guard:
    """A model's cross-rank check: its mesh's channel and its own timeout."""

    channel: SideChannel
    timeout_s: float

    def check(self, kind, code, label, presence=None, timeout_s=None) -> list[bool] | None:
        return run_check(self.channel, kind, code, label, presence, timeout_s or self.timeout_s)


# --------------------------------------------------------------------------- the check

_labels: dict[tuple[int, int], str] = {}  # (kind, code) -> what this rank knows it to be
_published: set[tuple[int, int]] = set()


def describe(kind: int, code: int, label: str, publish: bool = True) -> None:
    """Remember (and publish for the peers' error messages) what a (kind, code) stands for."""
    key = (kind, code)
    _labels.setdefault(key, label)
    if not publish or key in _published:
        return
    _published.add(key)
    store = default_store()
    if store is not None:
        try:
            store.set(f"zero3/label/{kind}/{code}", label)
        except Exception:  # noqa: BLE001  - only the error messages would be poorer
            log.debug("zero3: could not publish the label of %s", key, exc_info=True)


def run_check(
    channel: SideChannel | None,
    kind: int,
    code: int,
    label: str,
    presence: list[bool] | None = None,
    timeout_s: float | None = None,
) -> list[bool] | None:
    """Exchange (kind, code) with every rank of the channel; raise unless all are equal.

    Returns, when ``presence`` is given, the element-wise OR of every rank's presence bits.
    """
    if channel is None:
        return presence
    describe(kind, code, label, publish=kind not in (KIND_EAGER_GATHER, KIND_EAGER_REDUCE))
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    with channel.lock:
        channel.count += 1
        count = channel.count
        record = torch.zeros(_WORDS, dtype=torch.int64)
        record[0], record[1], record[2], record[3] = _MAGIC, kind, code, count
        if presence is not None:
            for word, value in enumerate(_pack(presence)):
                record[_HEADER + word] = value
        try:
            records = channel.exchange(record, timeout)
        except Exception as error:  # noqa: BLE001  (timeout, or a peer's connection closed)
            raise CollectiveMismatchError(
                _lost_peer_message(channel, count, label, timeout, error)
            ) from error
    mine = (kind, code)
    differing = [
        i for i in range(len(channel.ranks)) if (int(records[i, 1]), int(records[i, 2])) != mine
    ]
    if differing:
        raise CollectiveMismatchError(_mismatch_message(channel, records, label))
    if presence is None:
        return None
    union = [False] * len(presence)
    for i in range(len(channel.ranks)):
        for j, bit in enumerate(_unpack(records[i, _HEADER:].tolist(), len(presence))):
            union[j] = union[j] or bit
    return union


def _pack(presence: list[bool]) -> list[int]:
    words = [0] * _PRESENCE_WORDS
    for j, bit in enumerate(presence[:MAX_PRESENCE]):
        if bit:
            words[j // _BITS] |= 1 << (j % _BITS)
    return words


def _unpack(words: list[int], n: int) -> list[bool]:
    # beyond the record's capacity every output counts as present (plain torch.compile semantics)
    return [j >= MAX_PRESENCE or bool(words[j // _BITS] >> (j % _BITS) & 1) for j in range(n)]


def _what(kind: int, code: int) -> str:
    label = _labels.get((kind, code))
    if label is None:
        store = default_store()
        key = f"zero3/label/{kind}/{code}"
        try:
            if store is not None and store.check([key]):
                label = store.get(key).decode()
        except Exception:  # noqa: BLE001
            label = None
    name = KIND_NAMES.get(kind, f"kind {kind}")
    return f"{name} {label}" if label else f"{name} (code {code:#x}, not known on this rank)"


def _mismatch_message(channel: SideChannel, records: torch.Tensor, label: str) -> str:
    lines = [
        "zero3: the ranks are about to issue different collectives, which would hang them or mix "
        "unrelated buffers:"
    ]
    whats = _peer_labels(channel, records, label)
    for i, rank in enumerate(channel.ranks):
        count = int(records[i, 3])
        you = " (this rank)" if i == channel.me else ""
        lines.append(f"  rank {rank}{you}, check #{count}: {whats[i]}")
    kinds = {int(records[i, 1]) for i in range(len(channel.ranks))}
    shapes = _one_parameter_shapes(whats)
    if shapes is not None:
        name, by_rank = shapes
        listed = ", ".join(f"{shape} on rank {channel.ranks[i]}" for i, shape in by_rank)
        lines.append(
            f"Parameter {name} has different shapes on the ranks ({listed}): the ranks built "
            "different models (another configuration, a vocabulary resized or a module added on "
            "some ranks only). Build the same model on every rank: zero3_compile.shard() checks "
            "this when it shards, a module assigned to the model afterwards is sharded as each "
            "rank has it."
        )
    elif len(kinds) == 1 and len(set(whats)) == 1:
        lines.append(
            "Each rank runs the same graph over the same parameters, but with other sizes or "
            "dtypes: a parameter has another shape or dtype on some ranks (a model built from "
            "another configuration, a module resized or added on some ranks after "
            "zero3_compile.shard()), or the ranks compiled with other options. Build the same "
            "model on every rank; an eager forward (without torch.compile) names the parameter "
            "and its shapes."
        )
    elif kinds & {KIND_EAGER_GATHER, KIND_EAGER_REDUCE}:
        lines.append(
            "Parameters read by code that runs eagerly (an uncompiled model, or code split off by "
            "a graph break) are gathered at each read. When which parameters are read depends on "
            "the data (a mixture-of-experts loop over the experts that received tokens), gather "
            "the whole block on every rank: zero3_compile.set_leaf_modules(model, [BlockClass]) "
            "(modules with an 'experts' child are detected automatically)."
        )
    else:
        lines.append(
            "Every rank must run the same compiled graphs in the same order. A graph that runs a "
            "data-dependent number of times (a loop over the experts that received tokens, split "
            "by graph breaks) needs its block gathered as a whole: "
            "zero3_compile.set_leaf_modules(model, [BlockClass]); a rank-dependent branch in "
            "forward must go."
        )
    return "\n".join(lines)


_PEER_WAIT_S = 2.0  # how long a mismatch waits for the peers' own words for their collective


def _peer_labels(channel: SideChannel, records: torch.Tensor, label: str) -> list[str]:
    """What each rank was about to do, in its own words: every rank that sees the mismatch
    posts its label in the store (all of them see it, at the same check), then reads the others'
    (a rank that does not post in time is described from the labels this rank knows)."""
    me = channel.me
    kind = int(records[me, 1])
    own = f"{KIND_NAMES.get(kind, f'kind {kind}')} {label}"
    store = default_store()
    prefix = f"zero3/mismatch/{channel.name}/{int(records[me, 3])}/"
    if store is not None:
        try:
            store.set(prefix + str(channel.ranks[me]), own)
        except Exception:  # noqa: BLE001  - only the message would be poorer
            store = None
    whats = []
    for i, rank in enumerate(channel.ranks):
        if i == me:
            whats.append(own)
            continue
        theirs = None
        if store is not None:
            try:
                store.wait([prefix + str(rank)], timedelta(seconds=_PEER_WAIT_S))
                theirs = store.get(prefix + str(rank)).decode()
            except Exception:  # noqa: BLE001
                theirs = None
        whats.append(theirs or _what(int(records[i, 1]), int(records[i, 2])))
    return whats


_ONE_PARAMETER = re.compile(r"^eager (?:all-gather|reduce-scatter) ('.*') of shape (\(.*\))$")


def _one_parameter_shapes(whats: list[str]):
    """(name, [(rank index, shape)]) when every rank was about to gather (or reduce) the same
    parameter under other shapes; else None."""
    found = [_ONE_PARAMETER.match(w) for w in whats]
    if not all(found):
        return None
    names = {m.group(1) for m in found}
    shapes = [m.group(2) for m in found]
    if len(names) != 1 or len(set(shapes)) == 1:
        return None
    return names.pop(), list(enumerate(shapes))


def _lost_peer_message(
    channel: SideChannel, count: int, label: str, timeout: float, error: Exception
) -> str:
    silent = lost_ranks(f"zero3/rollcall/{channel.name}/{count}/", channel.ranks, _ROLL_CALL_S)
    who = f"rank(s) {silent}" if silent else "a peer rank"
    text = str(error)
    if any(sign in text for sign in ("Connection closed", "Connection reset", "Broken pipe")):
        # gloo reports a dead peer's closed sockets at once: no timeout was waited for
        what = f"{who} lost its connection (the process died or left the process group)"
        ending = "Stopping instead of hanging."
    else:
        what = f"{who} did not arrive within {timeout:.0f}s or lost its connection"
        ending = "The rank died, is stuck, or is running other code; stopping instead of hanging."
    first = text.splitlines()[0][:300] if text else ""
    return (
        f"zero3: rank {dist.get_rank()} waited for every rank at check #{count} "
        f"({label}), but {what} ({type(error).__name__}: {first}). {ending}"
    )
