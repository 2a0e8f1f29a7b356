"""Offloaded tensors read and written through the tensor and DTensor API.

```python
p = dict(model.named_parameters())["0.weight"]        # shard(offload=Offload(params="disk"))
full = p.full_tensor()                                 # read from the store: the exact values
with torch.no_grad():
    p.copy_(full.chunk(world)[rank] * 0)              # a new version in the store
    opt.state[p]["exp_avg"].to_local().zero_()         # offload_optimizer's state, the same
```
An offloaded shard or optimizer state tensor holds no memory while its values are in a store:
its storage is resized to zero bytes, and the compiled graphs and the optimizer's tiles fill that
very tensor, or read the store by its storage, when they need it. A kernel that read it directly
would read freed memory (a segmentation fault). So the ``DTensor`` a user holds
(``model.parameters()``, ``optimizer.state[p][key]``) is an ``OffloadedDTensor`` while it is
offloaded: its operations, ``to_local()``, ``redistribute()`` / ``full_tensor()``, ``.data``,
``repr``, ``copy.deepcopy`` and pickling see its values as a ``LiveTensor``:

- a read (``p.full_tensor()``, ``p.to_local().clone()``, ``p.data.sum()``) reads the committed
  values from the store into a temporary;
- a write (``p.copy_(v)``, ``p.data.mul_(2)``, ``p.to_local()[0].zero_()``) loads the values,
  runs, writes them back as a new committed version and evicts them again;
- views (``.data``, ``to_local()``, ``[0]``, ``.view(-1)``) are ``LiveTensor``s of their own
  that replay the view on the values at each use.

While the values are in memory (during a step, inside ``offload.params.loaded``) everything runs
on the tensor itself. Compiled graphs see plain ``DTensor``s (dynamo fakes a subclass through
``DTensor.__tensor_unflatten__``), and a graph compiled for a model whose shards were not
offloaded refuses to run while ``offload_states`` holds them (``__tensor_flatten__``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from .._torch.dtensor import local_tensor, spec_of
from .._torch.fx import schema_of
from .._torch.pytree import tree_flatten, tree_map
from .._torch.tensors import allow_foreach, make_wrapper_subclass

aten = torch.ops.aten

_VALUES = "_zero3_values"  # an OffloadedDTensor's OffloadedValues, in its __dict__


class OffloadedValues(Protocol):
    """Where the values of one offloaded tensor are, and how to read and write them."""

    key: Any  # one per underlying tensor: two objects with one key are one tensor's values
    name: str  # for messages: "parameter 'layer.weight'", "optimizer state 'exp_avg'"
    device: torch.device  # where the values are used

    def evicted(self) -> bool:
        """Whether the values are only in the store (the tensor holds no memory)."""

    def tensor(self) -> torch.Tensor:
        """The tensor itself, or one of its shape, strides and dtype (on the meta device)."""

    def storage(self) -> torch.UntypedStorage:
        """The tensor's storage (zero bytes while evicted)."""

    def read(self) -> torch.Tensor:
        """The committed values: a temporary read from the store, or the tensor if resident."""

    def writing(self) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The tensor with its values, for a write; stored as a new version after the block."""

    def refuse_graphs(self) -> str | None:
        """A message if compiled graphs cannot run while the values are offloaded, else None."""


# --------------------------------------------------------------------------- the local values


class LiveTensor(torch.Tensor):
    """The values of an offloaded tensor (or a view of them) without memory of its own: each
    operation reads them from the store, or writes a new version (module docstring)."""

    _values: OffloadedValues
    _views: tuple  # (func, args, kwargs, index) replayed on the values, in order

    @staticmethod
    def __new__(cls, values: OffloadedValues, views: tuple = (), like: torch.Tensor | None = None):
        base = values.tensor()
        like = base if like is None else like
        self = make_wrapper_subclass(
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=base.dtype,
            device=values.device,
            requires_grad=False,
        )
        self._values, self._views = values, views
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"{self._values.name} (offloaded): {self._replay(self._values.read())!r}"

    def __reduce_ex__(self, protocol):
        # pickled (torch.save, a checkpoint writer) as the values it stands for
        return self._replay(self._values.read()).clone().__reduce_ex__(protocol)

    def untyped_storage(self) -> torch.UntypedStorage:
        """The offloaded tensor's own storage (zero bytes while its values are in the store)."""
        return self._values.storage()

    def _replay(self, base: torch.Tensor) -> torch.Tensor:
        """This tensor's view of ``base`` (the values)."""
        out = base
        for func, args, kwargs, index in self._views:
            out = func(out, *args, **kwargs)
            if index is not None:
                out = out[index]
        return out

    def _view(self, func, args, kwargs):
        """A view op: a ``LiveTensor`` of the view (shape and strides from the meta device)."""
        probe = func(self._replay(_meta_like(self._values.tensor())), *args, **kwargs)
        if isinstance(probe, (list, tuple)):
            return type(probe)(
                LiveTensor(self._values, (*self._views, (func, args, kwargs, i)), p)
                for i, p in enumerate(probe)
            )
        return LiveTensor(self._values, (*self._views, (func, args, kwargs, None)), probe)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REFUSED or torch.Tag.inplace_view in func.tags:
            raise RuntimeError(
                f"zero3: {func} would change an offloaded tensor's storage or shape in place; "
                "its values live in the offload store. Write them with copy_() (under "
                "torch.no_grad() for a parameter), or work on a copy (clone())"
            )
        if func is aten.is_pinned.default:
            return False
        if (
            func.is_view
            and args
            and isinstance(args[0], LiveTensor)
            and not _holds_live((args[1:], kwargs))
        ):
            return args[0]._view(func, args[1:], kwargs)
        return _run(func, args, kwargs)


# operations that would give the tensor new storage or a new size (with those torch tags
# ``inplace_view``: transpose_, squeeze_, as_strided_...): refused by name
_REFUSED = {
    aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor,
    aten.set_.default,
    aten.resize_.default,
    aten.resize_as_.default,
}


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``tensor``'s shape, strides and offset (to compute a view's)."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    extent = extent if all(tensor.shape) else 0
    flat = torch.empty(tensor.storage_offset() + extent, dtype=tensor.dtype, device="meta")
    return flat.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _holds_live(tree) -> bool:
    return any(isinstance(t, LiveTensor) for t in tree_flatten(tree)[0])


def written_arguments(func, args, kwargs) -> list:
    """The tensors an operation writes (its schema's mutable arguments), lists flattened."""
    written = []
    for index, argument in enumerate(schema_of(func).arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.kwarg_only or index >= len(args):
            value = kwargs.get(argument.name)
        else:
            value = args[index]
        if isinstance(value, (list, tuple)):
            written.extend(value)
        elif value is not None:
            written.append(value)
    return written


def _written(func, args, kwargs) -> list:
    """The live tensors an operation writes."""
    return [t for t in written_arguments(func, args, kwargs) if isinstance(t, LiveTensor)]


def _run(func, args, kwargs):
    """Any other operation: the values it reads read from the store; the values it writes
    loaded, written and stored as a new version; results that are written arguments handed
    back as the ``LiveTensor``s that stood for them."""
    written = _written(func, args, kwargs)
    written_ids = {id(t) for t in written}
    with contextlib.ExitStack() as stack:
        bases: dict[Any, torch.Tensor] = {}
        for tensor in written:  # loaded before anything reads (an op may read what it writes)
            if tensor._values.key not in bases:
                bases[tensor._values.key] = stack.enter_context(tensor._values.writing())
        handed_back: dict[int, LiveTensor] = {}

        def real(value):
            if not isinstance(value, LiveTensor):
                return value
            key = value._values.key
            if key not in bases:
                bases[key] = value._values.read()
            out = value._replay(bases[key])
            if id(value) in written_ids:
                handed_back[id(out)] = value
            return out

        out = func(*tree_map(real, args), **tree_map(real, kwargs))
        return tree_map(lambda o: handed_back.get(id(o), o), out)


# --------------------------------------------------------------------------- the DTensor


class OffloadedDTensor(DTensor):
    """A ``DTensor`` whose local values may be offloaded (module docstring). The same object as
    before (its class changed in place): parameter groups, optimizer state keys and compiled
    graphs keep referring to it."""

    __slots__ = ()  # DTensor's layout: a DTensor becomes one in place

    def _zero3_live(self) -> DTensor | None:
        """A ``DTensor`` over a ``LiveTensor`` of the values while they are offloaded."""
        values = self.__dict__.get(_VALUES)
        if values is None or not values.evicted():
            return None
        return DTensor(LiveTensor(values), spec_of(self), requires_grad=False)

    def _zero3_alias(self) -> OffloadedDTensor:
        """``detach()``, ``.data``, ``view_as(self)``: another ``OffloadedDTensor`` of the same
        values (a ``Parameter`` made from one must be of its class; a compiled graph traced
        over one takes one)."""
        alias = DTensor(local_tensor(self).detach(), spec_of(self), requires_grad=False)
        alias.__class__ = OffloadedDTensor
        values = self.__dict__.get(_VALUES)
        if values is not None:
            alias.__dict__[_VALUES] = values
        return alias

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if isinstance(args[0], OffloadedDTensor) and (
            func in _ALIASES or (func is aten.view.default and tuple(args[1]) == args[0].shape)
        ):  # detach(), .data, view_as(itself) (the gate of a compiled graph's inputs)
            return args[0]._zero3_alias()
        originals: dict[int, OffloadedDTensor] = {}

        def swap(value):
            if not isinstance(value, OffloadedDTensor):
                return value
            live = value._zero3_live()
            if live is None:
                live = DTensor(
                    local_tensor(value), spec_of(value), requires_grad=value.requires_grad
                )
            originals[id(live)] = value
            return live

        args, kwargs = tree_map(swap, (tuple(args), kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map(lambda o: originals.get(id(o), o), out)

    def _zero3_differentiable(self) -> DTensor:
        """This tensor, or while offloaded its live values (gradients flow back to it)."""
        if torch.compiler.is_compiling() or self._zero3_live() is None:
            return self
        if torch.is_grad_enabled() and self.requires_grad:
            return _Live.apply(self)
        return self._zero3_live()

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        return DTensor.to_local(self._zero3_differentiable(), grad_placements=grad_placements)

    def redistribute(self, *args, **kwargs) -> DTensor:
        return DTensor.redistribute(self._zero3_differentiable(), *args, **kwargs)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        # the fake and functional values of graphs traced over it are of its class too (graphs
        # compiled for it check their inputs' classes at every call)
        out = DTensor.__tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride)
        out.__class__ = OffloadedDTensor
        return out

    def __tensor_flatten__(self):
        values = self.__dict__.get(_VALUES)
        if values is not None and values.evicted():
            refusal = values.refuse_graphs()
            if refusal is not None:
                raise RuntimeError(refusal)
        return DTensor.__tensor_flatten__(self)

    def __repr__(self) -> str:
        live = self._zero3_live()
        if live is None:
            return DTensor.__repr__(self)
        return (
            f"DTensor(local_tensor={local_tensor(live)!r}, device_mesh={spec_of(self).mesh}, "
            f"placements={spec_of(self).placements})"
        )

    def _zero3_copy(self) -> DTensor:
        """A plain ``DTensor`` holding a copy of the values (a ``Parameter`` if this is one)."""
        values = self.__dict__.get(_VALUES)
        with torch.no_grad():
            if values is not None and values.evicted():
                local = values.read()
            else:
                local = local_tensor(self).clone()
        copy = DTensor(local, spec_of(self), requires_grad=False)
        if isinstance(self, torch.nn.Parameter):  # a Parameter of this subclass
            return torch.nn.Parameter(copy, requires_grad=self.requires_grad)
        return copy.requires_grad_(self.requires_grad)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = self._zero3_copy()
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return self._zero3_copy().__reduce_ex__(protocol)


_ALIASES = (aten.detach.default, aten.alias.default)


class _Live(torch.autograd.Function):
    """An offloaded ``DTensor``'s live values (``OffloadedDTensor._zero3_live``), through which
    gradients reach it: ``p.to_local()`` and ``p.full_tensor()`` stay differentiable."""

    @staticmethod
    def forward(ctx, dtensor: OffloadedDTensor) -> DTensor:
        return dtensor._zero3_live()

    @staticmethod
    def backward(ctx, grad: DTensor) -> DTensor:
        return grad


allow_foreach(OffloadedDTensor)  # the optimizers' foreach paths, as over DTensor (same bits)


def make_offloaded(dtensor: DTensor, values: OffloadedValues) -> None:
    """Make ``dtensor`` (in place) an ``OffloadedDTensor`` whose values ``values`` describes."""
    if type(dtensor) is DTensor:
        dtensor.__class__ = OffloadedDTensor
    if isinstance(dtensor, OffloadedDTensor):
        dtensor.__dict__[_VALUES] = values


def make_plain(dtensor: DTensor) -> None:
    """Undo ``make_offloaded``: ``dtensor`` is a plain ``DTensor`` again."""
    if type(dtensor) is OffloadedDTensor:
        dtensor.__class__ = DTensor
    dtensor.__dict__.pop(_VALUES, None)


def values_of(tensor) -> OffloadedValues | None:
    """The ``OffloadedValues`` of an ``OffloadedDTensor`` (or of a ``LiveTensor``), else None."""
    if isinstance(tensor, LiveTensor):
        return tensor._values
    if isinstance(tensor, OffloadedDTensor):
        return tensor.__dict__.get(_VALUES)
    return None


__all__ = [
    "LiveTensor",
    "OffloadedDTensor",
    "OffloadedValues",
    "make_offloaded",
    "make_plain",
    "values_of",
]
