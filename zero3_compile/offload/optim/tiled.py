"""``OptimizerOffload``: an optimizer's state in an offload store between steps, streamed
through ``step()`` in tiles.

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
optimizer is elementwise (``tiles.ELEMENTWISE``: each element's update reads only that element's
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
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..._torch.dtensor import local_tensor
from ...sharding.state import state_of
from ..access import make_offloaded
from ..deferred import StoredTensor, reads_deferred
from ..grads import spooled, with_local
from ..incoming import IncomingTensor, incoming, loads_incoming
from ..params import evict as evict_shard
from ..params import fill as fill_shard
from ..store import DiskStore, HostStore, Region, aligned_empty
from .tiles import ELEMENTWISE, PIECE_ALIGN, Feed, Piece, Undo, local_of


class OptimizerOffload:
    """The state of one optimizer in its store: a region per (parameter, state key), evicted
    between steps. Steps passes of tiles (``step``, ``run``; the in-backward steps feed ``run``
    too), undoes a failed one (``undo``), makes a pass's writes current (``commit``), and packs
    and loads state dicts through the store."""

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
        self.pool: torch.Tensor | None = None  # the pieces' staging buffers, during a step
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
                        make_offloaded(value, _StateValues(self, param, key, local_tensor(value)))

    def _offloadable(self, param) -> dict[str, torch.Tensor]:
        """The param's state tensors that go to the store, as local (per-rank) tensors."""
        state = self.optimizer.state.get(param, {})
        return {
            k: local_of(v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0
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

    def commit(self, params) -> None:
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

    def nbytes(self, param) -> int:
        local = local_of(param)
        per_element = local.element_size()
        kinds = max(len(self._offloadable(param)), 2)  # before the first step: Adam-sized
        kinds += spooled(param) is not None
        return local.numel() * per_element * (kinds + 1)

    def _tiles(self, params) -> list[list]:
        """Lists of whole parameters of about ``tile_bytes`` together, and one-piece lists of
        the parameters that step in pieces."""
        tiles, current, size = [], [], 0
        for param in params:
            nbytes = self.nbytes(param)
            pieces = self.pieces(param, nbytes)
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
    def slots(self) -> int:
        # tiles i - 2 (its write in flight), i - 1, i (stepping), i + 1 .. i + read_ahead (read)
        return self.read_ahead + 3

    def staging_pool(self, tiles, started) -> torch.Tensor | None:
        """One buffer for the pieces' shards, gradients and states, ``slots`` of the largest
        piece: allocated once per step (never less than 34 MiB of address space, pages only
        touched where used: glibc maps it and unmaps it whole, so freeing it does not raise its
        dynamic mmap threshold and leave later allocations in a fragmented heap)."""
        pieces = [t[0] for t in tiles if isinstance(t[0], Piece)]
        if not pieces:
            return None
        slot = max(self._piece_bytes(p, started) for p in pieces)
        self._slot_bytes = slot
        return aligned_empty((max(slot * self.slots, 34 * 2**20),), torch.uint8)

    def _piece_bytes(self, piece: Piece, started) -> int:
        numel = piece.stop - piece.start
        tensors = [local_of(piece.param)] * 2  # its shard and gradient, at most
        tensors += [
            local_of(v)
            for v in started[id(piece.param)].values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return sum(_aligned(numel * t.element_size()) for t in tensors)

    def pieces(self, param, nbytes: int) -> list[Piece]:
        """The pieces of a parameter larger than a tile (none: it steps whole)."""
        numel = local_of(param).numel()
        if nbytes <= self.tile_bytes or type(self.optimizer) not in ELEMENTWISE:
            return []
        per_piece = self.tile_bytes * numel // nbytes // PIECE_ALIGN * PIECE_ALIGN
        per_piece = max(per_piece, PIECE_ALIGN)
        if per_piece >= numel:
            return []
        starts = range(0, numel, per_piece)
        return [Piece(param, a, min(a + per_piece, numel), a + per_piece >= numel) for a in starts]

    def step(self, params: list | None = None, commit: bool = True):
        """Step ``params`` (default: every parameter with a gradient); ``commit=False`` leaves
        the new versions pending for the caller's ``commit``."""
        optimizer = self.optimizer
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        undo = Undo(optimizer, params)
        started = {id(p): dict(optimizer.state.get(p, {})) for p in params}
        feed = Feed(self.slots, self._tiles(params))
        self.pool = self.staging_pool(feed.tiles, started)
        try:
            self.run(feed, started)
        except BaseException:
            self.undo(undo)
            raise
        finally:
            self.pool = None
        if commit:
            self.commit(params)
        return None

    def undo(self, undo: Undo) -> None:
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

    def run(self, feed: Feed, started, count_wait=None) -> None:
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
            if isinstance(tile[0], Piece):
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
                if isinstance(tile[0], Piece):
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
        if not isinstance(tile[0], Piece):
            for param in tile:
                self._load(param)
            return
        piece = tile[0]
        param = piece.param
        start, numel = piece.start, piece.stop - piece.start
        local = local_of(param)
        taken = 0

        def take(dtype: torch.dtype) -> torch.Tensor:
            nonlocal taken
            begin = piece.slot * self._slot_bytes + taken
            nbytes = numel * dtype.itemsize
            taken += _aligned(nbytes)
            return self.pool[begin : begin + nbytes].view(dtype)

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
            piece.grad = local_of(param.grad).reshape(-1)[start : piece.stop]
        # the state as the step started (a copy of each scalar: every piece counts the same
        # step), each tensor's piece read from the store or viewed in memory
        for key, value in started[id(param)].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state = local_of(value)
                handle = (id(param), key)
                if handle in self.evicted:
                    part = take(state.dtype)
                    self.store.read_part(self.regions[handle], part, start * state.element_size())
                else:
                    part = state.reshape(-1)[start : piece.stop]
                piece.state[key] = part
            else:
                piece.state[key] = value.clone() if isinstance(value, torch.Tensor) else value

    def _step_piece(self, piece: Piece) -> None:
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

    def _claim_piece_state(self, piece: Piece) -> None:
        """On the stepping thread, before the piece's write is submitted: the store regions of
        state this step created and the evicted placeholders of the whole. Two pieces' writes run
        at once on the workers; claimed there, both could find no region and allocate one each,
        and the state's earlier pieces would be lost in a region no longer used."""
        param = piece.param
        local = local_of(param)
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
                whole[key] = with_local(param, empty)
                self.evicted.add(handle)

    def _write_piece(self, piece: Piece) -> None:
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
                self._evict_one(handle, local_of(whole[key]))
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
        self.commit(loaded)
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
                entry[key] = with_local(entry[key], copy)
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
                state[key] = with_local(value, empty)
                self.evicted.add(handle)
        self.store_all()

    def prepare_load(self) -> list[tuple[int, str]]:
        """Before a checkpoint load into an optimizer that has no state yet: its state created
        evicted, each tensor a store region the load writes (``offload/incoming.py``), instead
        of DCP's step with zero gradients (which reads every parameter and writes every state
        tensor and shard only for the load to overwrite them). Only for the optimizers of
        ``ELEMENTWISE`` (state tensors shaped like the parameter): the keys, dtypes and scalars
        come from one step of the same optimizer on a two-element parameter per group and dtype.
        Returns the handles created (``abandon_load`` forgets them if the load fails)."""
        optimizer = self.optimizer
        if any(optimizer.state.values()) or type(optimizer) not in ELEMENTWISE:
            return []
        created = []
        for group in optimizer.param_groups:
            probes: dict[tuple, dict[str, Any]] = {}
            for param in group["params"]:
                local = local_of(param)
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
                    state[key] = with_local(param, empty)
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

    def __init__(self, offloaded: OptimizerOffload, param, key: str, local: torch.Tensor):
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
