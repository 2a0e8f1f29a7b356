"""Offloaded values handed out without reading them: ``StoredTensor``.

A checkpoint save asks for every parameter shard and optimizer state tensor at once
(``get_state_dict``); reading them all back first would bring the whole offloaded state into
memory, exactly what offload avoids (at 1.5B parameters on 2 ranks: 20 GB for a step that peaks
at 16). Inside ``deferred_reads()`` the offloaded model's ``state_dict()`` and an offloaded
optimizer's ``state_dict()`` return ``StoredTensor``s instead: tensors of the right shape and
dtype that hold no memory and read the committed values when something needs them. The
checkpoint writer reads each right before writing it (``io/checkpoint.py``), so a save holds one
tensor at a time.

Any operation on a ``StoredTensor`` reads it (values exact); writing to one is refused: it
stands for a committed version in a store, which only the owner of the store replaces.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .._torch.dtensor import local_tensor
from .._torch.fx import schema_of
from .._torch.pytree import tree_leaves, tree_map
from .._torch.tensors import make_wrapper_subclass
from .store import Region, read_target

aten = torch.ops.aten


class Switch:
    """A per-thread, re-entrant switch: on inside ``with switch():``, off again after it."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def on(self) -> bool:
        return getattr(self._local, "depth", 0) > 0


_deferred = Switch()


def deferred_reads() -> contextlib.AbstractContextManager[None]:
    """Offloaded state dicts in the block hand out ``StoredTensor``s (see the module docstring)."""
    return _deferred()


def reads_deferred() -> bool:
    return _deferred.on()


def wrapper_tensor(cls, shape, dtype, device, strides=None) -> torch.Tensor:
    """A tensor subclass instance of ``shape`` (contiguous strides) that holds no storage."""
    if strides is None:
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        strides = tuple(reversed(strides))
    return make_wrapper_subclass(
        cls, shape, strides=strides, dtype=dtype, device=device, requires_grad=False
    )


class RegionTensor(torch.Tensor):
    """A tensor with the shape and dtype of a store region's values that holds no memory. Its
    aliases (``detach``, ``DTensor.from_local``'s view) are of its kind; what any other
    operation does, each kind says (``_operate``)."""

    _store: object
    _region: Region

    def __init__(self, *args, **kwargs):
        pass

    def _alias(self) -> RegionTensor:
        alias = wrapper_tensor(type(self), self.shape, self.dtype, self.device, self.stride())
        alias._store, alias._region = self._store, self._region
        return alias

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._alias()
        if func in (aten.view.default, aten._unsafe_view.default):
            if tuple(args[1]) == tuple(args[0].shape):  # DTensor.from_local's view_as
                return args[0]._alias()
        if func is aten.is_pinned.default:
            return False
        return cls._operate(func, args, kwargs)

    @classmethod
    def _operate(cls, func, args, kwargs):
        raise NotImplementedError


class StoredTensor(RegionTensor):
    """The committed values of one store region, read on use (see the module docstring)."""

    @staticmethod
    def __new__(cls, store, region: Region, shape, dtype, device):
        self = wrapper_tensor(cls, shape, dtype, device)
        self._store = store
        offset = region.read_offset
        snapshot = Region((offset, offset), region.nbytes, source=region.source)
        if hasattr(region, "buffers"):  # host memory: the current buffer
            snapshot.buffers = [region.buffers[region.current]]  # type: ignore[attr-defined]
        self._region = snapshot
        return self

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"StoredTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def materialize(self) -> torch.Tensor:
        out = read_target(self._store, self.shape, self.dtype, self.device)
        self._store.read(self._region, out)
        return out

    @classmethod
    def _operate(cls, func, args, kwargs):
        for index, argument in enumerate(schema_of(func).arguments):
            written = argument.alias_info is not None and argument.alias_info.is_write
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if written and isinstance(value, StoredTensor):
                raise RuntimeError(
                    f"zero3: {func} would write to an offloaded value handed out by a state "
                    "dict under deferred_reads(); clone() it first (that reads it)"
                )

        def read(value):
            return value.materialize() if isinstance(value, StoredTensor) else value

        return func(*tree_map(read, args), **tree_map(read, kwargs))


def materialized(value):
    """``value`` read into memory if it is a ``StoredTensor`` (or a DTensor holding one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and isinstance(local_tensor(value), StoredTensor):
        return DTensor.from_local(
            local_tensor(value).materialize(),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, StoredTensor):
        return value.materialize()
    return value


def holds_deferred(state) -> bool:
    """Whether a (nested) state dict holds any ``StoredTensor``."""
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(v, StoredTensor)
        or (isinstance(v, DTensor) and isinstance(local_tensor(v), StoredTensor))
        for v in tree_leaves(state)
    )


__all__ = [
    "RegionTensor",
    "StoredTensor",
    "Switch",
    "deferred_reads",
    "holds_deferred",
    "materialized",
]
