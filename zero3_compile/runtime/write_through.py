"""Eager reads of ``module.weight`` return the full tensor; writes to it must reach the shards.

Users write to parameters after wrapping all the time: ``model.apply(init_fn)``,
``module.reset_parameters()``, ``module.weight.mul_(2)`` under ``no_grad``,
``module.bias.data.fill_(0.5)``, EMA updates. A gathered temporary would swallow those writes
silently. So an eager read returns the gathered tensor as a ``GatheredParameter``: any op that
changes it in place (directly or through a view, ``.data`` included) writes this rank's chunk of
the result back into the shard. Every rank runs the same write on the same full value, so the
shards stay consistent (random initialisers draw the full tensor from each rank's generator, as
the unsharded model would).

Reading ``.grad`` gives the sharded parameter's gradient, and ``requires_grad_`` / the
``requires_grad`` setter act on the sharded parameter: the temporary has neither a gradient nor a
say in training. Inside ``torch.compile`` the getter returns the plain traced value and in-place
writes to parameters are refused at compile time (``passes/param_writes.py``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .._torch.dtensor import local_tensor
from .._torch.pytree import tree_flatten, tree_map
from .._torch.tensors import disable_torch_function_subclass, version
from ..sharding.state import ShardedParam


class _Link:
    """The gathered root tensor a ``GatheredParameter`` (or a view of it) belongs to."""

    __slots__ = ("root", "state")

    def __init__(self, root: torch.Tensor, state: ShardedParam):
        self.root = root
        self.state = state

    @torch.no_grad()
    def write_back(self) -> None:
        from ..offload.params import loaded

        state = self.state
        rows = state.spec.local_view(self.root, state.rank)
        if not rows.shape[0]:
            return
        if state.offload is not None:  # into the store, as a new version
            with loaded([state], write_back=True):
                state.local().copy_(rows.to(state.local().dtype))
            return
        local = state.local()
        local.copy_(rows.to(local.dtype))


def _descriptor_access(func) -> tuple[str, str] | None:
    """("grad", "__get__") for ``t.grad``, ("data", "__set__") for ``t.data = v``..."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__") and type(owner).__name__ == "getset_descriptor":
        return getattr(owner, "__name__", ""), name
    return None


def _writes_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


class GatheredParameter(torch.Tensor):
    """A full parameter gathered for eager code; in-place writes go through to the shard."""

    _zero3_link: _Link

    def sharded_shape(self) -> tuple[int, ...]:
        """The full shape of the parameter this tensor was read from."""
        return tuple(self._zero3_link.state.full_shape)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # a gathered tensor that eager code handed to a compiled frame: a plain input there
            return _plain(func, args, kwargs)
        return _eager_torch_function(func, args, kwargs)


def _plain(func, args, kwargs):
    with disable_torch_function_subclass():
        return func(*args, **kwargs)


def _eager_torch_function(func, args, kwargs):
    """Run ``func``; write in-place changes of gathered parameters back to their shards."""
    flat, _ = tree_flatten((args, kwargs))
    links = {id(t._zero3_link): t._zero3_link for t in flat if isinstance(t, GatheredParameter)}
    access = _descriptor_access(func)
    if access == ("grad", "__get__"):
        return args[0]._zero3_link.state.param.grad
    if access == ("is_leaf", "__get__") and whole_parameter(args[0]) is not None:
        from .optimizers import optimizer_param

        if optimizer_param(args[0]):  # handed to an optimizer: it holds the sharded parameter
            return True
    if access == ("_base", "__get__"):
        # plain: a linked base would be a fresh view of it, whose _base is another (torch 2.11's
        # dynamo follows _base chains of its inputs to the end)
        return _plain(func, args, kwargs)
    if access == ("requires_grad", "__set__") or func is torch.Tensor.requires_grad_:
        value = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        args[0]._zero3_link.state.param.requires_grad_(value)
        return args[0] if func is torch.Tensor.requires_grad_ else None
    versions = {key: version(link.root) for key, link in links.items()}
    # ``.data`` views have a version counter of their own: name the in-place ops as well
    target = args[0] if args and isinstance(args[0], GatheredParameter) else None
    in_place = target is not None and _writes_in_place(func)
    with disable_torch_function_subclass():
        out = func(*args, **kwargs)
    if access == ("data", "__set__") and target is not None:
        with torch.no_grad(), disable_torch_function_subclass():
            target._zero3_link.root.copy_(args[1])
        in_place = True
    for key, link in links.items():
        if version(link.root) != versions[key] or (in_place and target._zero3_link is link):
            link.write_back()
    if not links:
        return out
    return tree_map(lambda t: _rewrap(t, links), out)


def _rewrap(value, links: dict):
    """Results sharing a root's storage (views, ``.data``, in-place results) stay linked."""
    if not isinstance(value, torch.Tensor) or isinstance(value, GatheredParameter):
        return value
    try:
        ptr = value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return value
    for link in links.values():
        if ptr == link.root.untyped_storage().data_ptr():
            return _wrap(value, link)
    return value


def _wrap(tensor: torch.Tensor, link: _Link) -> GatheredParameter:
    out = tensor.as_subclass(GatheredParameter)
    out._zero3_link = link
    return out


def gathered_parameter(full: torch.Tensor, state: ShardedParam) -> GatheredParameter:
    """Wrap an eagerly gathered full parameter so that writes to it reach ``state``'s shard."""
    out = _wrap(full, _Link(full, state))
    out.__dict__[_WHOLE] = True
    return out


_WHOLE = "_zero3_whole"


def whole_parameter(value) -> torch.Tensor | None:
    """The sharded parameter ``value`` is the whole eager read of (``module.weight``, not a view
    of it; also under its tensor-parallel ``DTensor``); None for anything else."""
    if isinstance(value, GatheredDTensor):
        value = local_tensor(value)
    if isinstance(value, GatheredParameter) and value.__dict__.get(_WHOLE):
        return value._zero3_link.state.param
    return None


class GatheredDTensor(DTensor):
    """A tensor-parallel parameter gathered for eager code: the TP ``DTensor`` over a
    ``GatheredParameter``. DTensor runs ops on its local tensor below autograd, where neither the
    local tensor's write-through nor its version counter sees them: an in-place change shows in
    this wrapper's own version counter, and is written back to the shard here."""

    __slots__ = ()  # DTensor's layout: an eager read's DTensor becomes one in place

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return _plain(func, args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        with disable_torch_function_subclass():  # reading attributes would come back here
            links = [
                (t, local_tensor(t)._zero3_link)
                for t in flat
                if isinstance(t, GatheredDTensor) and isinstance(local_tensor(t), GatheredParameter)
            ]
            if _descriptor_access(func) == ("grad", "__get__") and links:
                return links[0][1].state.param.grad
            versions = [version(t) for t, _ in links]
            out = func(*args, **kwargs)
            changed = [link for (t, link), v in zip(links, versions) if version(t) != v]
        for link in changed:
            link.write_back()
        return out


def gathered_tp(value):
    """``value`` (the TP-wrapped gathered tensor, or the plain one) with write-through; the same
    tensor object, so its autograd history (eager training) is kept."""
    if type(value) is DTensor and isinstance(local_tensor(value), GatheredParameter):
        value.__class__ = GatheredDTensor
    return value
