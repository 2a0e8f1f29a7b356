"""Optimizer state that lives in an offload store between steps, streamed through ``step()``.

```python
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), tier="disk", path=p)
```
Any ``torch.optim`` optimizer whose state is per parameter (SGD with momentum, Adam, AdamW,
Adagrad, RMSprop...). Between steps its state tensors (``exp_avg``, ``momentum_buffer``...; not
the 0-dim ``step`` counters) are in the store and hold no memory. ``step()`` walks the parameters
in tiles of about ``tile_mb``: it reads tile i+1 (states, and offloaded parameter shards) while
tile i steps, and writes tile i-1 back meanwhile, so at most ``read_ahead + 2`` tiles are in
memory. The inner optimizer runs unchanged on each tile, so results are bit-identical to the
same optimizer without offload.

A parameter larger than a tile (a 128256 x 3072 embedding's shard is 0.79 GB of fp32, 3.2 GB with
its gradient and AdamW's two moments) steps in pieces of whole 4096-element runs when the
optimizer is elementwise (``_ELEMENTWISE``: each element's update reads only that element's
gradient and state): each piece of the shard, its gradient and its state is read from the store
into buffers of its own, stepped as a parameter of its own (the group's hyperparameters, a copy
of the step counter) and written back, so the parameter is never whole in memory; the results
are the same bits. Other optimizers step such a parameter whole.

Writes go to the free slot of each region and become current only when every tile was written
(``DiskStore.commit``): a step interrupted by an I/O error leaves the previous state on disk.

``state_dict()`` returns the state read back (tensors of their own); ``load_state_dict()`` stores
what it loaded; ``zero3_compile.save_checkpoint`` / ``load_checkpoint`` (DCP) go through both.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..sharding.state import state_of
from .access import make_offloaded
from .deferred import StoredTensor, reads_deferred
from .grads import spooled, with_local
from .incoming import IncomingTensor, incoming, loads_incoming
from .params import _evict as evict_shard
from .params import _fill as fill_shard
from .store import DiskStore, HostStore, Region, aligned_empty

log = logging.getLogger(__name__)


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    tier: str = "disk",
    path: str | None = None,
    *,
    tile_mb: float = 64.0,
    read_ahead: int = 1,
    threads: int = 4,
    o_direct: bool = False,
    poison: bool = False,
    double_buffer: bool = True,
    in_backward: bool = False,
) -> torch.optim.Optimizer:
    """Keep ``optimizer``'s state in ``tier`` ("disk" or, for accelerator models, "cpu") between
    steps; returns the same optimizer object (``isinstance`` checks and DCP keep working).

    ``double_buffer=False``: one copy of the state on disk, rewritten in place (half the disk);
    a step that fails on an I/O error then loses the state it was writing (reads of it raise:
    resume from a checkpoint) instead of keeping the previous one.

    ``in_backward=True``: each parameter steps during the backward, as soon as its gradient is
    reduced, so the state's I/O runs beside the backward's compute; ``step()`` waits for the
    last steps and commits. Needs ``Offload(params=..., grads=...)`` and an elementwise
    optimizer; refuses gradient clipping, scaling and accumulation (``in_backward.py``).

    Example:
        ```python
        opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), tier="disk", path="/nvme/run1")
        loss_fn(step_model(x)).backward()
        opt.step()  # the state streams through in tiles
        ```
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"zero3: offload_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "zero3: offload_optimizer needs an optimizer whose state is per parameter; LBFGS "
            "keeps a history across all parameters and re-evaluates a closure"
        )
    if tier not in ("disk", "cpu"):
        raise ValueError(f"zero3: offload_optimizer(tier={tier!r}) must be 'disk' or 'cpu'")
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if tier == "cpu" and devices <= {"cpu"}:
        raise ValueError(
            "zero3: offload_optimizer(tier='cpu') keeps state in host memory for accelerator "
            "models; this optimizer's parameters already live in host memory. Use tier='disk'."
        )
    if not (isinstance(read_ahead, int) and read_ahead >= 0):
        raise ValueError(f"zero3: read_ahead must be an int >= 0, got {read_ahead!r}")
    if getattr(optimizer, "_zero3_tiled", False):
        raise ValueError("zero3: this optimizer is offloaded already")
    rank = dist.get_rank() if dist.is_initialized() else 0
    store = (
        HostStore()
        if tier == "cpu"
        else DiskStore(
            path, "optimizer", rank, threads=threads, o_direct=o_direct, double_buffer=double_buffer
        )
    )
    if in_backward:
        from .in_backward import check_setup

        params = [p for g in optimizer.param_groups for p in g["params"]]
        check_setup(optimizer, {p: state_of(p) for p in params})
    offloaded = _OptimizerOffload(optimizer, store, int(tile_mb * 2**20), read_ahead, poison)
    if in_backward:
        from .grads import take_gradients
        from .in_backward import InBackward
        from .params import keep_reloads

        offloaded.in_backward = InBackward(offloaded)
        for param in params:
            # a tied parameter's gradient comes in parts (one per use, eager or across graphs):
            # it is spooled, and steps in step()
            if not state_of(param).tied:
                take_gradients(state_of(param), offloaded.in_backward.take)
                keep_reloads(state_of(param), offloaded.in_backward.keep)
    optimizer.__dict__["_zero3_tiled"] = True
    optimizer.__dict__["_zero3_offload"] = offloaded
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.state_dict = types.MethodType(_state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(_load_state_dict, optimizer)
    if any(optimizer.state.values()):  # state that exists already goes to the store now
        offloaded.store_all()
        offloaded.mark_states()
    return optimizer


def _step(self, closure=None):
    if closure is not None:
        raise ValueError(
            "zero3: an offloaded optimizer steps in tiles and cannot re-evaluate a closure; "
            "compute the loss and call backward() before step()"
        )
    offloaded = self._zero3_offload
    try:
        if offloaded.in_backward is not None:
            return offloaded.in_backward.step()
        return offloaded.step()
    finally:
        offloaded.mark_states()


def _state_dict(self):
    return self._zero3_offload.state_dict()


def _load_state_dict(self, state_dict):
    try:
        return self._zero3_offload.load_state_dict(state_dict)
    finally:
        self._zero3_offload.mark_states()


# optimizers whose update of an element reads only that element's gradient and state (and
# per-parameter scalars): a parameter can step in pieces with the same result
_ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
_PIECE_ALIGN = 4096  # elements: a piece of any dtype starts at a 4096-byte boundary (O_DIRECT)


@dataclass(eq=False)
class _Piece:
    """Elements ``start .. stop`` of one parameter's flattened shard, stepped on their own."""

    param: torch.Tensor
    start: int
    stop: int
    last: bool
    slot: int = 0  # of the step's staging pool
    given: torch.Tensor | None = None  # the gradient shard, handed over by the backward
    values: torch.Tensor | None = None  # the whole shard as the backward's reload read it
    # (read only: the backward's collective may read it too)
    # read by the load: the piece's shard, gradient and state values (the step writes the
    # shard's in place); the state the step made, for the write
    shard: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)


class _Feed:
    """The tiles of one stepping pass, in order: all known when ``step()`` starts, or appended
    as the backward produces gradients (``in_backward``) until ``close()``. A piece's staging
    slot follows its position, so the tiles in memory together never share one."""

    def __init__(self, slots: int, tiles: list | None = None):
        self.slots = slots
        self.tiles: list[list] = []
        self.closed = False
        self.cond = threading.Condition()
        if tiles is not None:
            self.append(tiles)
            self.close()

    def append(self, tiles: list[list]) -> None:
        with self.cond:
            for tile in tiles:
                if isinstance(tile[0], _Piece):
                    tile[0].slot = len(self.tiles) % self.slots
                self.tiles.append(tile)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def peek(self, i: int) -> list | None:
        with self.cond:
            return self.tiles[i] if i < len(self.tiles) else None

    def get(self, i: int) -> list | None:
        """Tile ``i``, once it is there; None when the feed closed before it."""
        with self.cond:
            while i >= len(self.tiles) and not self.closed:
                self.cond.wait()
            return self.tiles[i] if i < len(self.tiles) else None

    def stepped(self, tile: list) -> None:
        """Tile ``tile`` stepped: what it held for the pass can go."""


class _Undo:
    """What undoing a pass over ``params`` needs: the small per-parameter values (step
    counters) as they were, and which parameters had no state before."""

    def __init__(self, optimizer, params: list):
        self.params: list = []
        self.scalars: dict = {}
        self.fresh: list = []
        self.add(optimizer, params)

    def add(self, optimizer, params: list) -> None:
        self.params.extend(params)
        for param in params:
            state = optimizer.state.get(param, {})
            if not state:
                self.fresh.append(param)
            for key, value in state.items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    copy = value.clone() if isinstance(value, torch.Tensor) else value
                    self.scalars[(param, key)] = copy


class _OptimizerOffload:
    def __init__(self, optimizer, store, tile_bytes: int, read_ahead: int, poison: bool):
        self.optimizer = optimizer
        self.store: DiskStore | HostStore = store
        self.tile_bytes = max(tile_bytes, 1)
        self.read_ahead = read_ahead
        self.poison = poison
        self.regions: dict[tuple[int, str], Region] = {}  # (id(param), key) -> region
        self.evicted: set[tuple[int, str]] = set()
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zero3-opt")
        self.tiles_resident_max = 0
        self.pieces_stepped = 0  # pieces of parameters larger than a tile, over all steps
        self._pool: torch.Tensor | None = None  # the pieces' staging buffers, during a step
        self._slot_bytes = 0
        self.grads_read: dict[int, torch.Tensor] = {}  # id(param) -> its spooled gradient, read
        self.in_backward = None  # in_backward.InBackward, with offload_optimizer(in_backward=True)

    # ------------------------------------------------------------------ tensors of a param

    def mark_states(self) -> None:
        """Every state tensor with a store region read and written through it while evicted
        (``access.OffloadedDTensor``: ``optimizer.state[p]["exp_avg"].full_tensor()``...)."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for key, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, DTensor) and (id(param), key) in self.regions:
                        make_offloaded(value, _StateValues(self, param, key, value._local_tensor))

    def _offloadable(self, param) -> dict[str, torch.Tensor]:
        """The param's state tensors that go to the store, as local (per-rank) tensors."""
        state = self.optimizer.state.get(param, {})
        return {
            k: _local(v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0
        }

    def _load(self, param) -> None:
        for key, tensor in self._offloadable(param).items():
            handle = (id(param), key)
            if handle in self.evicted:
                if not self.poison:
                    tensor.untyped_storage().resize_(self.regions[handle].nbytes)
                self.store.read(self.regions[handle], tensor)
                self.evicted.discard(handle)
        shard = state_of(param)
        if shard is not None and shard.offload is not None and shard.offload.evicted:
            fill_shard(shard)
        grad = spooled(param)
        if grad is not None:  # an offloaded gradient (Offload(grads=...)) is read with its tile
            self.grads_read[id(param)] = grad.materialize()

    def _write(self, param) -> None:
        """Write the param's (changed) state, and its offloaded shard, to the free slots."""
        for key, tensor in self._offloadable(param).items():
            handle = (id(param), key)
            if handle in self.evicted:  # nothing in memory: its store holds it
                continue
            region = self.regions.get(handle)
            if region is None:
                region = self.regions[handle] = self.store.allocate(
                    tensor.numel() * tensor.element_size()
                )
            self.store.write(region, tensor.contiguous())
        shard = state_of(param)
        if shard is not None and shard.offload is not None and not shard.offload.evicted:
            shard.offload.store.write(shard.offload.region, shard.local().detach().contiguous())

    def _evict(self, param) -> None:
        for key, tensor in self._offloadable(param).items():
            self._evict_one((id(param), key), tensor)
        shard = state_of(param)
        if shard is not None and shard.offload is not None and not shard.offload.evicted:
            evict_shard(shard)

    def _regions(self, params):
        """The store regions of ``params``: their optimizer state and offloaded shards."""
        for param in params:
            for key in self._offloadable(param):
                region = self.regions.get((id(param), key))
                if region is not None:
                    yield region
            shard = state_of(param)
            if shard is not None and shard.offload is not None:
                yield shard.offload.region

    def _commit(self, params) -> None:
        for region in self._regions(params):
            region.commit()

    def _abandon(self, params) -> None:
        """A step failed: forget its writes and its in-memory values; every offloaded tensor
        reads its previous, committed version again. (Parameters that are not offloaded were
        updated in place for the tiles that stepped: restore them from a checkpoint.)"""
        self._discard(params)
        for param in params:
            for key in self._offloadable(param):
                handle = (id(param), key)
                if handle in self.regions and handle not in self.evicted:
                    self._evict_one(handle, self._offloadable(param)[key])
            shard = state_of(param)
            if shard is not None and shard.offload is not None and not shard.offload.evicted:
                evict_shard(shard)

    def _evict_one(self, handle, tensor) -> None:
        with torch.no_grad():
            if self.poison:
                tensor.fill_(float("nan"))
            else:
                tensor.untyped_storage().resize_(0)
        self.evicted.add(handle)

    def _discard(self, params) -> None:
        for region in self._regions(params):
            region.discard()

    # ------------------------------------------------------------------ the step

    def _nbytes(self, param) -> int:
        local = _local(param)
        per_element = local.element_size()
        kinds = max(len(self._offloadable(param)), 2)  # before the first step: Adam-sized
        kinds += spooled(param) is not None
        return local.numel() * per_element * (kinds + 1)

    def _tiles(self, params) -> list[list]:
        """Lists of whole parameters of about ``tile_bytes`` together, and one-piece lists of
        the parameters that step in pieces."""
        tiles, current, size = [], [], 0
        for param in params:
            nbytes = self._nbytes(param)
            pieces = self._pieces(param, nbytes)
            if pieces or (current and size + nbytes > self.tile_bytes):
                if current:
                    tiles.append(current)
                current, size = [], 0
            if pieces:
                tiles.extend([piece] for piece in pieces)
                continue
            current.append(param)
            size += nbytes
        if current:
            tiles.append(current)
        return tiles

    @property
    def _slots(self) -> int:
        # tiles i - 2 (its write in flight), i - 1, i (stepping), i + 1 .. i + read_ahead (read)
        return self.read_ahead + 3

    def _staging_pool(self, tiles, started) -> torch.Tensor | None:
        """One buffer for the pieces' shards, gradients and states, ``_slots`` of the largest
        piece: allocated once per step (never less than 34 MiB of address space, pages only
        touched where used: glibc maps it and unmaps it whole, so freeing it does not raise its
        dynamic mmap threshold and leave later allocations in a fragmented heap)."""
        pieces = [t[0] for t in tiles if isinstance(t[0], _Piece)]
        if not pieces:
            return None
        slot = max(self._piece_bytes(p, started) for p in pieces)
        self._slot_bytes = slot
        return aligned_empty((max(slot * self._slots, 34 * 2**20),), torch.uint8)

    def _piece_bytes(self, piece: _Piece, started) -> int:
        numel = piece.stop - piece.start
        tensors = [_local(piece.param)] * 2  # its shard and gradient, at most
        tensors += [
            _local(v)
            for v in started[id(piece.param)].values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return sum(_aligned(numel * t.element_size()) for t in tensors)

    def _pieces(self, param, nbytes: int) -> list[_Piece]:
        """The pieces of a parameter larger than a tile (none: it steps whole)."""
        numel = _local(param).numel()
        if nbytes <= self.tile_bytes or type(self.optimizer) not in _ELEMENTWISE:
            return []
        per_piece = self.tile_bytes * numel // nbytes // _PIECE_ALIGN * _PIECE_ALIGN
        per_piece = max(per_piece, _PIECE_ALIGN)
        if per_piece >= numel:
            return []
        starts = range(0, numel, per_piece)
        return [_Piece(param, a, min(a + per_piece, numel), a + per_piece >= numel) for a in starts]

    def step(self, params: list | None = None, commit: bool = True):
        """Step ``params`` (default: every parameter with a gradient); ``commit=False`` leaves
        the new versions pending for the caller's ``_commit``."""
        optimizer = self.optimizer
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        undo = _Undo(optimizer, params)
        started = {id(p): dict(optimizer.state.get(p, {})) for p in params}
        feed = _Feed(self._slots, self._tiles(params))
        self._pool = self._staging_pool(feed.tiles, started)
        try:
            self.run(feed, started)
        except BaseException:
            self.undo(undo)
            raise
        finally:
            self._pool = None
        if commit:
            self._commit(params)
        return None

    def undo(self, undo: _Undo) -> None:
        """A pass failed or was refused: its writes forgotten, its values read again from the
        committed versions, the state it created dropped, the step counters set back."""
        optimizer = self.optimizer
        self._abandon(undo.params)
        self.grads_read.clear()
        for param in undo.fresh:  # back to "no state yet", as before the step
            optimizer.state.pop(param, None)
            for key in [k for k in self.regions if k[0] == id(param)]:
                self.regions.pop(key)
                self.evicted.discard(key)
        for (param, key), value in undo.scalars.items():
            state = optimizer.state[param]
            if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                state[key].copy_(value)
            else:
                state[key] = value

    def run(self, feed: _Feed, started, count_wait=None) -> None:
        """Step the tiles of ``feed`` as they come: tile i+1 .. i+read_ahead read while tile i
        steps, tile i-1 written meanwhile. On an error every load and write in flight is
        waited for before it is raised (the caller then undoes the pass). ``count_wait``
        receives the seconds it waited for I/O (default: the store's, as time training waited)."""
        count_wait = count_wait or self.store.count_wait
        loads: dict[int, Future] = {}
        writes: list[Future] = []

        def load(i: int) -> None:
            tile = feed.peek(i)
            if tile is not None and i not in loads:
                loads[i] = self.workers.submit(self._load_tile, tile, started)

        def write_and_evict(tile) -> None:
            if isinstance(tile[0], _Piece):
                self._write_piece(tile[0])
                return
            for param in tile:
                self._write(param)
            for param in tile:
                self._evict(param)

        try:
            i = 0
            while (tile := feed.get(i)) is not None:
                for j in range(i, i + 1 + self.read_ahead):
                    load(j)
                waited = time.perf_counter()
                loads.pop(i).result()
                if i >= 2:  # write-behind one tile deep: memory stays bounded, errors surface
                    writes[i - 2].result()
                count_wait(time.perf_counter() - waited)
                resident = len(loads) + 1 + sum(not w.done() for w in writes)
                self.tiles_resident_max = max(self.tiles_resident_max, resident)
                if isinstance(tile[0], _Piece):
                    self._step_piece(tile[0])
                    self._claim_piece_state(tile[0])
                    if tile[0].last and writes:
                        # the parameter's other pieces are written before its last one evicts
                        # what they read from (a shard or state stepped in place)
                        writes[-1].result()
                else:
                    self._step_tile(tile)
                writes.append(self.workers.submit(write_and_evict, tile))
                feed.stepped(tile)
                i += 1
            waited = time.perf_counter()
            for future in writes:
                future.result()
            count_wait(time.perf_counter() - waited)
        except BaseException:
            for future in list(loads.values()) + writes:
                try:
                    future.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise

    def _load_tile(self, tile, started) -> None:
        if not isinstance(tile[0], _Piece):
            for param in tile:
                self._load(param)
            return
        piece = tile[0]
        param = piece.param
        start, numel = piece.start, piece.stop - piece.start
        local = _local(param)
        taken = 0

        def take(dtype: torch.dtype) -> torch.Tensor:
            nonlocal taken
            begin = piece.slot * self._slot_bytes + taken
            nbytes = numel * dtype.itemsize
            taken += _aligned(nbytes)
            return self._pool[begin : begin + nbytes].view(dtype)

        shard = state_of(param)
        if piece.values is not None:
            # read by the backward's gather (whose collective may still read them): copied
            piece.shard = take(local.dtype).copy_(piece.values.view(-1)[start : piece.stop])
        elif shard is not None and shard.offload is not None and shard.offload.evicted:
            piece.shard = take(local.dtype)
            shard.offload.store.read_part(
                shard.offload.region, piece.shard, start * local.element_size()
            )
        else:  # in memory: stepped in place
            piece.shard = local.view(-1)[start : piece.stop]
        if piece.given is not None:  # param.grad is the backward's to set meanwhile
            piece.grad = piece.given.reshape(-1)[start : piece.stop]
        elif (grad := spooled(param)) is not None:
            piece.grad = grad.materialize_part(start, take(grad.dtype))
        else:
            piece.grad = _local(param.grad).reshape(-1)[start : piece.stop]
        # the state as the step started (a copy of each scalar: every piece counts the same
        # step), each tensor's piece read from the store or viewed in memory
        for key, value in started[id(param)].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state = _local(value)
                handle = (id(param), key)
                if handle in self.evicted:
                    part = take(state.dtype)
                    self.store.read_part(self.regions[handle], part, start * state.element_size())
                else:
                    part = state.reshape(-1)[start : piece.stop]
                piece.state[key] = part
            else:
                piece.state[key] = value.clone() if isinstance(value, torch.Tensor) else value

    def _step_piece(self, piece: _Piece) -> None:
        """Step one piece as a parameter of its own, with its group's hyperparameters, through
        a view of the optimizer: its groups and state are never swapped, so the in-backward
        stepping thread leaves them to the training thread (``zero_grad`` meanwhile)."""
        optimizer = self.optimizer
        alone = torch.nn.Parameter(piece.shard, requires_grad=piece.param.requires_grad)
        alone.grad = piece.grad
        view = object.__new__(type(optimizer))
        view.__dict__.update(optimizer.__dict__)  # hyperparameters, defaults, hooks
        view.param_groups = [
            dict(g, params=[alone] if any(p is piece.param for p in g["params"]) else [])
            for g in optimizer.param_groups
        ]
        view.state = collections.defaultdict(dict)
        if piece.state:
            view.state[alone] = piece.state
        type(optimizer).step(view)
        piece.state = view.state.pop(alone, {})
        piece.grad = None
        self.pieces_stepped += 1

    def _claim_piece_state(self, piece: _Piece) -> None:
        """On the stepping thread, before the piece's write is submitted: the store regions of
        state this step created and the evicted placeholders of the whole. Two pieces' writes run
        at once on the workers; claimed there, both could find no region and allocate one each,
        and the state's earlier pieces would be lost in a region no longer used."""
        param = piece.param
        local = _local(param)
        whole = self.optimizer.state.setdefault(param, {})
        for key, value in piece.state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                continue
            handle = (id(param), key)
            if handle not in self.regions:  # state this step created
                self.regions[handle] = self.store.allocate(local.numel() * value.element_size())
            if key not in whole:  # evicted from the start: its pieces go to the store only
                empty = torch.empty(local.shape, dtype=value.dtype, device=local.device)
                empty.untyped_storage().resize_(0)
                whole[key] = _like(param, empty)
                self.evicted.add(handle)

    def _write_piece(self, piece: _Piece) -> None:
        """Write the piece's shard and state to the stores' free slots; after the last piece
        the parameter's state holds the scalars and (evicted) tensors of the whole."""
        param, start = piece.param, piece.start
        shard = state_of(param)
        if shard is not None and shard.offload is not None:
            record = shard.offload
            record.store.write_part(record.region, piece.shard, start * piece.shard.element_size())
            if piece.last and not record.evicted:
                evict_shard(shard)
        whole = self.optimizer.state[param]  # claimed by ``_claim_piece_state``
        for key, value in piece.state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                if piece.last:
                    whole[key] = value
                continue
            handle = (id(param), key)
            self.store.write_part(self.regions[handle], value, start * value.element_size())
            if piece.last and handle not in self.evicted:  # it was in memory (stepped in place)
                self._evict_one(handle, _local(whole[key]))
        piece.shard, piece.state = None, {}

    def _step_tile(self, tile) -> None:
        optimizer = self.optimizer
        members = {id(p) for p in tile}
        saved = [group["params"] for group in optimizer.param_groups]
        # spooled gradients step as the values read with the tile; they stay spooled after it
        spooled_grads = {}
        for param in tile:
            value = self.grads_read.pop(id(param), None)
            if value is not None:
                spooled_grads[param] = param.grad
                param.grad = with_local(param, value)
        try:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in members]
            type(optimizer).step(optimizer)
        finally:
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = params
            for param, grad in spooled_grads.items():
                param.grad = grad

    # ------------------------------------------------------------------ state dicts

    def store_all(self) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        loaded = [p for p in params if self._offloadable(p)]
        try:
            for param in loaded:
                self._write(param)
        except BaseException:
            self._discard(loaded)
            raise
        self._commit(loaded)
        for param in loaded:
            self._evict(param)

    def state_dict(self) -> dict[str, Any]:
        optimizer = self.optimizer
        packed = type(optimizer).state_dict(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        for param in params:
            entry = packed["state"].get(index[id(param)])
            if entry is None:
                continue
            # the packed entry is the optimizer's own per-parameter dict: never modify that one
            entry = packed["state"][index[id(param)]] = dict(entry)
            for key, local in self._offloadable(param).items():
                handle = (id(param), key)
                if handle in self.evicted and reads_deferred():  # read when it is written
                    region = self.regions[handle]
                    copy = StoredTensor(self.store, region, local.shape, local.dtype, local.device)
                elif handle in self.evicted and loads_incoming():  # a load writes it to the store
                    region = self.regions[handle]
                    copy = IncomingTensor(
                        self.store, region, local.shape, local.dtype, local.device
                    )
                elif handle in self.evicted:
                    copy = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                    self.store.read(self.regions[handle], copy)
                else:
                    copy = local.clone()
                entry[key] = _like(entry[key], copy)
        return packed

    def load_state_dict(self, state_dict) -> None:
        optimizer = self.optimizer
        type(optimizer).load_state_dict(optimizer, state_dict)
        self.evicted = set()  # the loaded tensors are new and in memory, but for those
        for param in [p for g in optimizer.param_groups for p in g["params"]]:
            state = optimizer.state.get(param, {})
            for key, value in list(state.items()):
                written = incoming(value)  # a checkpoint load wrote to the store already
                if written is None:
                    continue
                handle = (id(param), key)
                if self.regions.get(handle) is not written._region:
                    raise RuntimeError(
                        f"zero3: the optimizer state {key!r} loaded into another parameter's "
                        "store region than the one it was written to"
                    )
                empty = torch.empty(written.shape, dtype=written.dtype, device=written.device)
                empty.untyped_storage().resize_(0)
                state[key] = _like(value, empty)
                self.evicted.add(handle)
        self.store_all()

    def prepare_load(self) -> list[tuple[int, str]]:
        """Before a checkpoint load into an optimizer that has no state yet: its state created
        evicted, each tensor a store region the load writes (``offload/incoming.py``), instead
        of DCP's step with zero gradients (which reads every parameter and writes every state
        tensor and shard only for the load to overwrite them). Only for the optimizers of
        ``_ELEMENTWISE`` (state tensors shaped like the parameter): the keys, dtypes and scalars
        come from one step of the same optimizer on a two-element parameter per group and dtype.
        Returns the handles created (``abandon_load`` forgets them if the load fails)."""
        optimizer = self.optimizer
        if any(optimizer.state.values()) or type(optimizer) not in _ELEMENTWISE:
            return []
        created = []
        for group in optimizer.param_groups:
            probes: dict[tuple, dict[str, Any]] = {}
            for param in group["params"]:
                local = _local(param)
                kind = (local.dtype, local.device)
                if kind not in probes:
                    probes[kind] = _fresh_state(type(optimizer), group, local)
                state = optimizer.state[param] = {}
                for key, value in probes[kind].items():
                    if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                        state[key] = value.clone() if isinstance(value, torch.Tensor) else value
                        continue
                    handle = (id(param), key)
                    if handle not in self.regions:  # kept by a load that failed
                        nbytes = local.numel() * value.element_size()
                        self.regions[handle] = self.store.allocate(nbytes)
                    empty = torch.empty(local.shape, dtype=value.dtype, device=local.device)
                    empty.untyped_storage().resize_(0)
                    state[key] = _like(param, empty)
                    self.evicted.add(handle)
                    created.append(handle)
        return created

    def abandon_load(self, created: list[tuple[int, str]]) -> None:
        """A load into the state ``prepare_load`` created failed: the optimizer has no state
        again (its regions stay allocated for the next load or step, holding nothing)."""
        params = {id(p): p for g in self.optimizer.param_groups for p in g["params"]}
        for handle in created:
            self.optimizer.state.pop(params[handle[0]], None)
            self.evicted.discard(handle)
            region = self.regions[handle]
            region.pending, region.lost, region.source = None, False, None


class _StateValues:
    """The values of one offloaded optimizer state tensor (``access.OffloadedValues``)."""

    def __init__(self, offloaded: _OptimizerOffload, param, key: str, local: torch.Tensor):
        self.offloaded, self.handle, self.local = offloaded, (id(param), key), local
        self.key = (id(offloaded), self.handle)
        self.name = f"optimizer state {key!r}"

    def evicted(self) -> bool:
        return self.handle in self.offloaded.evicted

    @property
    def device(self) -> torch.device:
        return self.local.device

    def tensor(self) -> torch.Tensor:
        return self.local

    def storage(self) -> torch.UntypedStorage:
        return self.local.untyped_storage()

    def read(self) -> torch.Tensor:
        if not self.evicted():
            return self.local
        out = torch.empty(self.local.shape, dtype=self.local.dtype, device=self.local.device)
        self.offloaded.store.read(self.offloaded.regions[self.handle], out)
        return out

    @contextlib.contextmanager
    def writing(self):
        offloaded, handle = self.offloaded, self.handle
        if not self.evicted():
            yield self.local
            return
        region, local = offloaded.regions[handle], self.local.detach()
        if not offloaded.poison:
            local.untyped_storage().resize_(region.nbytes)
        offloaded.store.read(region, local)
        offloaded.evicted.discard(handle)
        try:
            yield local
            offloaded.store.write(region, local.contiguous())
            region.commit()
        except BaseException:
            region.discard()
            raise
        finally:
            offloaded._evict_one(handle, local)

    def refuse_graphs(self) -> str | None:
        return None


def _fresh_state(kind: type, group: dict, like: torch.Tensor) -> dict[str, Any]:
    """The state ``kind`` (an optimizer class) creates for a parameter of ``like``'s dtype and
    device in ``group`` at its first step (values of a two-element parameter)."""
    probe = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
    settings = {k: v for k, v in group.items() if k != "params"}
    if "lr" in settings:  # the step changes nothing (as DCP's initialising step)
        settings["lr"] = torch.tensor(0.0) if isinstance(settings["lr"], torch.Tensor) else 0.0
    optimizer = kind([{"params": [probe], **settings}])
    probe.grad = torch.zeros_like(probe)
    optimizer.step()
    return dict(optimizer.state[probe])


def _aligned(nbytes: int) -> int:
    """Buffers of the staging pool start at 4096-byte boundaries (O_DIRECT, no copy)."""
    return -(-nbytes // 4096) * 4096


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (what the store holds), outside autograd."""
    if isinstance(tensor, DTensor):
        return tensor._local_tensor.detach()
    return tensor.detach()


def _like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the same kind of tensor as ``template`` (a DTensor with its layout)."""
    if isinstance(template, DTensor):
        return DTensor.from_local(
            local,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    return local


__all__ = ["offload_optimizer"]
