"""Offloaded values a checkpoint load writes straight into their stores: ``IncomingTensor``.

A load used to ask for every offloaded parameter shard and optimizer state tensor as a tensor
in memory (their current values read from the stores, and an optimizer without state stepped
once with zero gradients to create it), let DCP copy the checkpoint into them, then write each
to its store: the whole offloaded state in memory at once (0.92 GB per rank at 125M, 9 GB at
1.5B), and every value read, written and written again.

Inside ``incoming_loads()`` the offloaded model's ``state_dict()`` and an offloaded optimizer's
``state_dict()`` hand out ``IncomingTensor``s instead: tensors of the right shape and dtype that
hold no memory and stand for a store region's next version. The checkpoint reader
(``io/checkpoint.py``) gives each item DCP reads a buffer of its own (``IncomingWrites.target``)
and, once DCP filled it, writes it to the region's free slot on a writer thread
(``arrived``); a load holds at most ``in_flight`` items besides the one being read. Nothing is
current until every rank read everything (``commit``); a failed load ``discard``s the writes.

Any operation on an ``IncomingTensor`` but its aliases is refused: it holds no values.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._torch.dtensor import local_tensor
from .deferred import RegionTensor, Switch, wrapper_tensor
from .store import ALIGN, Region, read_target

_HOST = torch.device("cpu")  # DCP reads the checkpoint into host memory; stores write from it
_incoming = Switch()


def incoming_loads() -> contextlib.AbstractContextManager[None]:
    """Offloaded state dicts in the block hand out ``IncomingTensor``s (module docstring)."""
    return _incoming()


def loads_incoming() -> bool:
    return _incoming.on()


class IncomingTensor(RegionTensor):
    """The next version of one store region, which a checkpoint load writes."""

    @staticmethod
    def __new__(cls, store, region: Region, shape, dtype, device):
        self = wrapper_tensor(cls, shape, dtype, device)
        self._store, self._region = store, region
        return self

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"IncomingTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def _operate(cls, func, args, kwargs):
        raise RuntimeError(
            f"zero3: {func} on an offloaded value a checkpoint load is writing to its store "
            "(it holds no values); load_checkpoint fills it"
        )


def incoming(value) -> IncomingTensor | None:
    """The ``IncomingTensor`` ``value`` is or holds (a DTensor's local tensor), else None."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = local_tensor(value)
    return value if isinstance(value, IncomingTensor) else None


class IncomingWrites:
    """The store writes of one checkpoint load, in the order DCP reads the items.

    An item covering the whole tensor, or whole rows from a 4096-byte boundary up to one (or up
    to the tensor's end), is written as it arrives; any other part (a load at another world
    size whose chunks cut rows, or unaligned ones) is gathered into the whole tensor in memory,
    written when its last element arrived."""

    def __init__(self, in_flight: int = 1):
        self.in_flight = in_flight
        self.pending: deque[tuple[Future, torch.Tensor]] = deque()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-load")
        self.regions: dict[int, Region] = {}  # id(region) -> region written
        self.partial: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(region) -> whole, filled
        # id(region) -> id(value) that writes it: of tied parameters (two keys, one shard) the
        # first key read; the other's items are read and dropped
        self.owners: dict[int, int] = {}
        self.bytes_written = 0

    def target(self, value: IncomingTensor, offsets: Sequence[int], lengths: Sequence[int]):
        """A tensor for DCP to copy the item at ``offsets`` (``lengths`` long) into."""
        if self.owners.setdefault(id(value._region), id(value)) != id(value):
            return torch.empty(tuple(lengths), dtype=value.dtype)  # read, then dropped
        if _direct_part(value, offsets, lengths) is not None:
            return read_target(value._store, tuple(lengths), value.dtype, _HOST)
        key = id(value._region)
        if key not in self.partial:
            whole = read_target(value._store, tuple(value.shape), value.dtype, _HOST)
            self.partial[key] = (whole, [0])
        whole = self.partial[key][0]
        for dim, (start, length) in enumerate(zip(offsets, lengths)):
            whole = whole.narrow(dim, start, length)
        return whole

    def arrived(
        self,
        value: IncomingTensor,
        offsets: Sequence[int],
        lengths: Sequence[int],
        filled: torch.Tensor,
    ) -> None:
        """DCP copied the item into ``filled`` (from ``target``): write it, or its whole tensor
        once complete."""
        region, store = value._region, value._store
        if self.owners[id(region)] != id(value):
            return
        self.regions[id(region)] = region
        start = _direct_part(value, offsets, lengths)
        if start is not None:
            if filled.numel() == value.numel():
                self._submit(filled, store.write, region, filled)
            else:
                self._submit(filled, store.write_part, region, filled, start)
            return
        whole, count = self.partial[id(region)]
        count[0] += filled.numel()
        if count[0] == whole.numel():
            del self.partial[id(region)]
            self._submit(whole, store.write, region, whole)

    def _submit(self, buffer: torch.Tensor, write, *args) -> None:
        while len(self.pending) >= self.in_flight:
            self.pending.popleft()[0].result()
        self.pending.append((self.writer.submit(write, *args), buffer))
        self.bytes_written += buffer.numel() * buffer.element_size()

    def drain(self) -> None:
        """Wait for every write (raising the first failure); refuse a tensor DCP did not fill."""
        try:
            while self.pending:
                self.pending.popleft()[0].result()
        finally:
            self.writer.shutdown(wait=True)
        if self.partial:
            raise RuntimeError(
                f"zero3: the checkpoint load filled {len(self.partial)} offloaded tensor(s) only "
                "in part: the checkpoint does not cover them"
            )

    def commit(self) -> None:
        for region in self.regions.values():
            region.commit()

    def discard(self) -> None:
        for future, _ in self.pending:
            future.cancel()
        self.writer.shutdown(wait=True)
        for region in self.regions.values():
            region.discard()


def _direct_part(value: IncomingTensor, offsets, lengths) -> int | None:
    """The byte offset an item is written at as it arrives (see ``IncomingWrites``), or None."""
    shape = tuple(value.shape)
    if tuple(offsets[1:]) != (0,) * (len(shape) - 1) or tuple(lengths[1:]) != shape[1:]:
        return None
    if not shape:
        return 0
    row = value.element_size()
    for size in shape[1:]:
        row *= size
    start, end = offsets[0] * row, (offsets[0] + lengths[0]) * row
    if start % ALIGN or (end % ALIGN and end != value.numel() * value.element_size()):
        return None
    return start


__all__ = ["IncomingTensor", "IncomingWrites", "incoming", "incoming_loads", "loads_incoming"]
