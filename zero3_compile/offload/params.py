"""Parameter shards that live in an offload store between uses.

An offloaded shard's tensor keeps its shape but holds no memory while evicted (its storage is
resized to zero bytes; with ``Offload(poison=True)`` it is filled with NaN instead, so a read
without a reload shows). It comes back:

- in compiled graphs: ``zero3::reload(shard, last, owned)`` nodes, issued ahead of the
  all-gather that needs them and waited (``wait_tensor``) right before the copy-in; the reloaded
  copy dies after the copy-in, nothing is written back (``passes/lower_gathers.py``,
  ``passes/prefetch.py``), unless an optimizer that steps in the backward keeps a backward
  graph's copy for the parameter's step (``keep_reloads``);
- in eager code (uncompiled models, graph breaks, leaf modules): a synchronous read into a
  temporary (``readable``);
- for the optimizer step, ``state_dict()`` / ``load_state_dict()`` and checkpoints: loaded into
  the parameter itself (``loaded``), and written back (as a new version, committed once every
  write succeeded) and evicted again when the values changed.

A shard a loader read from a checkpoint's rows (``origins.py``) is not written when it is
registered: its region reads those rows from the file until the first new version replaces them
(``store.FileRows``).

A model's setup (the ``Offload`` options, its store opened on every rank) is ``model.py``.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .._torch.tensors import storage_key
from .access import make_offloaded, make_plain
from .origins import take_origin
from .store import DiskStore, FileRows, HostStore, Region, read_target


class Residency(enum.Enum):
    RESIDENT = "resident"  # the shard's values are in its parameter
    EVICTED = "evicted"  # they are only in the store; the parameter holds no memory


@dataclass(eq=False)
class OffloadedShard:
    """The offload record of one sharded parameter."""

    store: DiskStore | HostStore
    region: Region
    poison: bool
    residency: Residency = Residency.RESIDENT

    @property
    def evicted(self) -> bool:
        return self.residency is Residency.EVICTED

    def mark(self, new: Residency) -> None:
        if new is self.residency:
            raise AssertionError(f"zero3: an offloaded shard is {new.value} already")
        self.residency = new

    @property
    def nbytes(self) -> int:
        return self.region.nbytes


# storage of an offloaded shard -> its parameter state (the graphs' reload op looks it up)
_by_storage: dict = {}
_lock = threading.Lock()


def offloaded(state) -> OffloadedShard | None:
    return getattr(state, "offload", None)


def register(
    state,
    store: DiskStore | HostStore,
    poison: bool,
    region: Region | None = None,
    non_blocking: bool = False,
) -> None:
    """Give ``state`` (a ShardedParam) a region in ``store`` (``region``: one it had before) and
    evict its shard."""
    local = _data(state)
    nbytes = local.numel() * local.element_size()
    record = OffloadedShard(store, region or store.allocate(nbytes), poison)
    state.offload = record
    with _lock:
        _by_storage[storage_key(local)] = state
    make_offloaded(state.param, ParamValues(state))  # read and written through the store
    pending = _deferred.get(id(store))
    if pending is None:
        store.write_current(record.region, local.contiguous(), non_blocking=non_blocking)
        evict(state)
        return
    if _leave_in_file(store, record.region, local):
        evict(state)
        return
    data = local.contiguous()
    pending.append((store.write_current_async(record.region, data), state, data))
    _settle(pending, keep=1)


def unregister(state) -> Region:
    """Undo ``register``: the shard's values back in its tensor, which the store no longer
    holds; returns the region that held them."""
    record = state.offload
    if record.evicted:
        fill(state)
    with _lock:
        _by_storage.pop(storage_key(_data(state)), None)
    state.offload = None
    make_plain(state.param)
    return record.region


# Shards registered inside ``deferred_writes``: their first write still in flight (store id ->
# [(future, state, the tensor written)]); evicted once written.
_deferred: dict[int, list] = {}


@contextlib.contextmanager
def deferred_writes(states: Iterable) -> Iterator[None]:
    """Inside: a shard registered into a disk store (``register_loaded``) is written on the
    store's I/O threads while the caller goes on (a loader reads and casts the next tensor), one
    write in flight at a time; each is evicted once written. At the end every write is waited
    for and evicted, and the first failure is raised. A shard stays resident (and readable)
    until its write has landed; nothing may change its values before the block ends."""
    states = list(states)
    roots = {id(s.root): s.root for s in states}.values()
    stores = [getattr(r, "offload_store", None) for r in roots]
    stores = [s for s in stores if isinstance(s, DiskStore) and id(s) not in _deferred]
    for store in stores:  # every region the load will allocate, at once
        store.reserve(
            [
                _data(s).numel() * _data(s).element_size()
                for s in states
                if s.offload is None and getattr(s.root, "offload_store", None) is store
            ]
        )
    lists = [_deferred.setdefault(id(s), []) for s in stores]
    try:
        yield
    except BaseException:
        for pending in lists:
            _settle(pending, keep=0, raising=False)
        raise
    finally:
        for store in stores:
            _deferred.pop(id(store), None)
    for pending in lists:
        _settle(pending, keep=0)


def _leave_in_file(store, region: Region, local: torch.Tensor) -> bool:
    """Whether the loader read ``local`` from a checkpoint file's rows (``origins.py``): then
    the region reads them from there until the first step writes a new version."""
    if not isinstance(store, DiskStore):
        return False
    origin = take_origin(local)
    if origin is None:
        return False
    file = store.source_file(origin.path, origin.identity)
    if file is None:  # the file at that path was replaced since it was read
        return False
    store.leave_in_file(region, FileRows(file, origin.offset, origin.dtype, local.dtype))
    return True


def _settle(pending: list, keep: int, raising: bool = True) -> None:
    """Wait for all but the newest ``keep`` writes of ``pending``; evict what they wrote."""
    failure = None
    while len(pending) > keep:
        future, state, _ = pending.pop(0)
        try:
            future.result()
        except BaseException as error:  # noqa: BLE001  - raised below, once all are waited
            failure = failure or error
        evict(state)
    if failure is not None and raising:
        raise failure


def _data(state) -> torch.Tensor:
    """The shard's tensor outside autograd (for I/O and eviction)."""
    return state.local().detach()


def evict(state) -> None:
    """Drop a resident offloaded shard's values from its parameter (its store holds them)."""
    record = state.offload
    local = _data(state)
    if record.poison:
        local.fill_(float("nan"))
    else:
        local.untyped_storage().resize_(0)
    record.mark(Residency.EVICTED)


def fill(state) -> None:
    """Bring an evicted shard back into its own parameter."""
    record = state.offload
    local = _data(state)
    if not record.poison:
        local.untyped_storage().resize_(record.nbytes)
    record.store.read(record.region, local)
    record.mark(Residency.RESIDENT)


class ParamValues:
    """The values of an offloaded parameter shard, for ``access.OffloadedDTensor``: reads read
    the store, writes load the shard and store it as a new version (``loaded``)."""

    def __init__(self, state):
        self.state = state
        self.key = state
        self.name = f"parameter {state.fqn!r}"

    def evicted(self) -> bool:
        return self.state.offload is not None and self.state.offload.evicted

    @property
    def device(self) -> torch.device:
        return self.state.param.device

    def tensor(self) -> torch.Tensor:
        return _data(self.state)

    def storage(self) -> torch.UntypedStorage:
        return _data(self.state).untyped_storage()

    def read(self) -> torch.Tensor:
        local = _data(self.state)
        if not self.evicted():
            return local
        record = self.state.offload
        out = read_target(record.store, local.shape, local.dtype, local.device)
        record.store.read(record.region, out)
        return out

    @contextlib.contextmanager
    def writing(self) -> Iterator[torch.Tensor]:
        if not self.evicted():
            yield _data(self.state)
            return
        with loaded([self.state], write_back=True):
            yield _data(self.state)

    def refuse_graphs(self) -> str | None:
        if getattr(self.state.root, "offload", None) is not None:
            return None  # the model's graphs reload offloaded shards themselves
        return (
            f"zero3: {self.state.fqn!r} is held in host memory or on disk by "
            "zero3_compile.offload_states(); call zero3_compile.reload_states(model, optimizer) "
            "before running the model"
        )


def state_of_storage(shard: torch.Tensor):
    key = storage_key(shard)
    with _lock:
        state = _by_storage.get(key)
        # a key whose storage died (a shard re-registered after its storage changed) can equal
        # a new storage at the same address: only the state whose shard is that storage counts
        if state is not None and storage_key(state.local()) != key:
            del _by_storage[key]
            return None
        return state


def readable(shard: torch.Tensor) -> torch.Tensor:
    """``shard`` itself, or for an evicted offloaded shard a temporary read from its store."""
    state = state_of_storage(shard)
    if state is None or not state.offload.evicted:
        return shard
    out = read_target(state.offload.store, shard.shape, shard.dtype, shard.device)
    state.offload.store.read(state.offload.region, out)
    return out


def reload_async(shard: torch.Tensor, last: bool = False, owned: bool = True):
    """A new tensor that receives ``shard``'s committed values from its store, and the function
    that waits for it (``wait_tensor`` calls it).

    ``last``: no later read of these values comes before the optimizer steps them (a backward
    graph's reload): a keeper registered for the parameter (``keep_reloads``) receives them once
    read, so the step need not read them again; ``owned=False``: the tensor is the graph's
    (Inductor reuses its buffer after its last use there), so the keeper receives a copy.

    Poison mode: the tensor holds NaN and the read only happens when it is waited for, so a
    consumer that reads it without the wait sees NaN, deterministically.
    """
    state = state_of_storage(shard)
    if state is None or not state.offload.evicted:
        return shard.clone(memory_format=torch.contiguous_format), _done
    out = read_target(state.offload.store, shard.shape, shard.dtype, shard.device)
    record = state.offload
    store = record.store
    keeper = _keepers.get(state) if last else None
    if record.poison:
        out.fill_(float("nan"))
        future = None
    else:
        future = store.read_async(record.region, out)

    def wait() -> None:
        if future is None:
            store.read(record.region, out)
        else:
            start = time.perf_counter()
            future.result()
            store.count_wait(time.perf_counter() - start)
        if keeper is not None:
            keeper(state, out if owned else out.clone())

    return out, wait


# ShardedParam -> keeper(state, values): receives the values of its backward's reloads
_keepers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keep_reloads(state, keeper) -> None:
    """``keeper(state, values)`` receives ``state``'s shard values each time a backward graph
    reloads them (``optim/in_backward.py``: the step that follows uses them instead of reading)."""
    _keepers[state] = keeper


def _done() -> None:
    return None


# --------------------------------------------------------------------------- whole-model access


def offloaded_states(model_or_params) -> list:
    from ..sharding.state import state_of

    params = (
        model_or_params.parameters()
        if isinstance(model_or_params, torch.nn.Module)
        else model_or_params
    )
    found, seen = [], set()
    for param in params:
        state = state_of(param)
        if state is not None and offloaded(state) is not None and id(state) not in seen:
            seen.add(id(state))
            found.append(state)
    return found


@contextlib.contextmanager
def loaded(states: Iterable, *, write_back: bool) -> Iterator[None]:
    """Offloaded shards in their parameters for the ``with`` block; evicted again after it
    (written back as a new, committed version first when ``write_back``)."""
    filled = []
    try:
        for state in states:
            if state.offload.evicted:
                fill(state)
                filled.append(state)
        yield
        if write_back:
            for state in filled:
                state.offload.store.write(state.offload.region, _data(state).contiguous())
            for state in filled:
                state.offload.region.commit()
    except BaseException:
        for state in filled:
            state.offload.region.discard()
        raise
    finally:
        for state in filled:
            evict(state)


def load_shards(states: Iterable) -> None:
    for state in states:
        if state.offload.evicted:
            fill(state)


def store_shards(states: Iterable) -> None:
    """Write loaded (changed) shards back as a new version, commit, evict."""
    states = [s for s in states if not s.offload.evicted]
    try:
        for state in states:
            state.offload.store.write(state.offload.region, _data(state).contiguous())
    except BaseException:
        for state in states:
            state.offload.region.discard()
        raise
    for state in states:
        state.offload.region.commit()
        evict(state)
