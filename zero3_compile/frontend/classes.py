"""The module class swap: every module of a sharded model gets a generated subclass of its class.

- one property per parameter name: reading ``module.weight`` returns the full tensor through the
  differentiable ``zero3::unshard`` operation, so unmodified forward code runs, eagerly or under
  ``torch.compile``. Under ``torch.compile`` the getter emits an unbound marker: the parameter's
  ``ShardSpec`` literal without its name (``ShardSpec.unbound_literal``) and ``UNBOUND_ID``, as
  constants of its code (read from a closure or an attribute, dynamo would treat the shape
  integers as inputs and, on a recompile, make them symbolic); the backend binds each marker to
  the parameter its shard is read from (``compiler/passes/bind.py``). So the layers of identical
  blocks share one generated class and dynamo compiles a block once for all of them
  (``for b in blocks: b.compile(backend="zero3")``).
- ``Zero3Module`` (``module.py``) among its bases: ``isinstance(m, z3.Zero3Module)`` and the
  methods integrations call.
- ``__setattr__`` / ``register_parameter`` (``assignment.py``): a parameter or module assigned
  after ``shard()`` is sharded on assignment; assigning a sharded parameter ties it.
- ``_apply``: ``model.to()``, ``.half()``, ``.float()`` work on the shards and re-attach the state.
- ``__reduce_ex__`` (``pickling.py``): ``torch.save(model)`` and ``copy.deepcopy(model)`` rebuild a
  sharded model instead of failing on an unimportable class.
- recurrent modules (``rnn.py``) read their weights through the getters for one forward at a time
  instead of caching full copies in ``_flat_weights``.

The class name stays the original's, so code that looks at ``type(m).__name__`` sees no change.
Generated classes are shared by modules with the same base class and the same parameter specs
but for the names (the same layer of every block, of every instance of a model), so dynamo
reuses compiled code across them.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..compat import local_shard
from ..sharding.spec import UNBOUND_ID
from ..sharding.state import ModuleState, ShardedParam, ShardState, module_state, set_module_state
from .module import Zero3Module

BASE = "_zero3_base_class"

_classes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def is_sharded_module(module: nn.Module) -> bool:
    return module_state(module) is not None


def base_class(module: nn.Module) -> type:
    """The module's class as the user defined it (before the swap)."""
    cls = type(module)
    return cls.__dict__.get(BASE, cls)


def make_sharded(module: nn.Module, state: ModuleState) -> None:
    set_module_state(module, state)
    if isinstance(module, nn.RNNBase):
        module.__dict__.pop("_flat_weights", None)  # full copies of the original weights
        module.__dict__["_flat_weight_refs"] = []
    reclass(module)


def class_namespace(base: type) -> dict:
    """The methods every generated class of ``base`` has (parameter properties aside)."""
    from .assignment import register_parameter, setattr_
    from .pickling import reduce_ex
    from .rnn import RNN_METHODS

    namespace = {
        BASE: base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__setattr__": setattr_,
        "register_parameter": register_parameter,
        "_apply": apply_,
        "__reduce_ex__": reduce_ex,
    }
    if issubclass(base, nn.RNNBase):
        namespace.update(RNN_METHODS)
    return namespace


def generated_class(base: type, namespace: dict) -> type:
    # after the base: a method the model defines itself wins over the mixin's
    bases = (base,) if issubclass(base, Zero3Module) else (base, Zero3Module)
    return type(base.__name__, bases, namespace)


def reclass(module: nn.Module) -> None:
    """Give ``module`` the generated class matching its base class and its parameters."""
    base = base_class(module)
    params = module_state(module).params
    key = (base, tuple(sorted((attr, *_share_key(s)) for attr, s in params.items())))
    cls = _classes.get(key)
    if cls is None:
        namespace = class_namespace(base)
        for attr, state in params.items():
            namespace[attr] = property(_make_getter(attr, state))
        cls = generated_class(base, namespace)
        _classes[key] = cls
    module.__class__ = cls


def _share_key(state: ShardedParam) -> tuple:
    """What a parameter shares with the same parameter of an identical block."""
    layout = None if state.layout is None else state.layout.key()
    return state.spec.unbound_literal(), layout


def _make_getter(attr: str, state: ShardedParam):
    """The property getter of one parameter: ``unshard`` of its local shard (an unbound marker
    while dynamo traces, see the module docstring; ``state`` gives only what the parameters of
    one generated class have in common).

    Inside a leaf module's forward the full parameter was gathered with the whole block; while
    gradient sync is off the full gradient goes to the parameter's sink instead of a collective,
    or the parameter kept gathered is read (``keep_gathered``, accumulation.py), detached while
    the parameter does not require grad (it gets no gradient from that micro-batch); inside
    ``z3.gathered`` the parameter gathered for it; while a loader works on the shards
    (``ShardState.LOADING``), the sharded parameter itself.
    Eager reads return a ``GatheredParameter`` that writes in-place changes back to the shard,
    with the model's runtime active around the collective (its timeout, its side channel).
    """
    param_dtype = state.spec.param_dtype
    # kept gathered in the shard's dtype (accumulation.py); computed with in param_dtype
    kept_expr = "kept" if param_dtype is None else f"kept.to({param_dtype!r})"
    # a tensor-parallel parameter: the gathered TP-local tensor as the module's TP DTensor
    # ([Note: zero3 over tensor parallelism]); a leaf's scope holds it wrapped already
    tp = (lambda expr: expr) if state.layout is None else (lambda expr: f"tp_wrap({expr})")
    # an eager read: the DTensor passes in-place writes on to the gathered tensor's write-through
    eager_tp = (lambda e: e) if state.layout is None else (lambda e: f"gathered_tp(tp_wrap({e}))")
    source = (
        "def get_full_parameter(self):\n"
        "    module_state = self.__dict__['_zero3']\n"
        "    scope = module_state.scope\n"
        f"    if scope is not None and {attr!r} in scope:\n"
        f"        return scope[{attr!r}]\n"
        f"    param_state = module_state.params[{attr!r}]\n"
        "    mode = param_state.state\n"
        "    sink = None\n"
        "    if mode is not SHARDED:\n"
        "        if mode is KEPT_GATHERED:\n"
        "            kept = param_state.kept_full\n"
        f"            if not self._parameters[{attr!r}].requires_grad:\n"
        "                kept = kept.detach()\n"
        f"            return {tp(kept_expr)}\n"
        "        if mode is GATHERED:\n"
        f"            return {tp('param_state.kept_full')}\n"
        "        if mode is LOADING:\n"
        f"            return self._parameters[{attr!r}]\n"
        f"        if self._parameters[{attr!r}].requires_grad:\n"
        "            sink = param_state.grad_sink\n"
        "    if is_compiling():\n"
        f"        shard = self._parameters[{attr!r}].to_local()\n"
        f"        full = unshard(shard, {UNBOUND_ID}, {state.spec.unbound_literal()!r}, sink)\n"
        f"        return {tp('full')}\n"
        f"    shard = local_shard(self._parameters[{attr!r}])\n"
        "    with param_state.root.active():\n"
        "        spec = param_state.spec.literal()\n"
        "        full = unshard(shard, param_state.param_id, spec, sink)\n"
        f"    return {eager_tp('gathered_parameter(full, param_state)')}\n"
    )
    from ..runtime.write_through import gathered_parameter, gathered_tp

    namespace = {
        "unshard": torch.ops.zero3.unshard.default,
        "is_compiling": torch.compiler.is_compiling,
        "local_shard": local_shard,
        "gathered_parameter": gathered_parameter,
        "SHARDED": ShardState.SHARDED,
        "KEPT_GATHERED": ShardState.KEPT_GATHERED,
        "GATHERED": ShardState.GATHERED,
        "LOADING": ShardState.LOADING,
        "torch": torch,
        "tp_wrap": None if state.layout is None else state.layout.wrap,
        "gathered_tp": gathered_tp,
    }
    exec(compile(source, f"<zero3 parameter {attr}>", "exec"), namespace)
    return namespace["get_full_parameter"]


def base_call(module: nn.Module, name: str, *args):
    return getattr(type(module).__dict__[BASE], name)(module, *args)


def apply_(self: nn.Module, fn, recurse: bool = True):
    """``model.to()`` and friends: apply ``fn`` to the shards, re-attach the parameters' states
    (``swap_tensors`` replaced their contents and attributes)."""
    evicted = {
        id(self._parameters.get(attr)): state
        for attr, state in module_state(self).params.items()
        if getattr(state, "offload", None) is not None and state.offload.evicted
    }
    if evicted:
        fn = _leaving_evicted_shards(fn, evicted)
    result = base_call(self, "_apply", fn, recurse)
    for attr, state in module_state(self).params.items():
        param = self._parameters.get(attr)
        if param is None:
            continue
        if not isinstance(param, DTensor) or tuple(param.shape) != state.global_shape:
            raise RuntimeError(
                f"zero3: {state.fqn} is no longer a sharded parameter of shape "
                f"{state.global_shape} after module._apply(); only dtype and device changes are "
                "supported on a sharded model"
            )
        state.attach(param)
    return result


def _leaving_evicted_shards(fn, evicted: dict):
    """``fn`` for ``_apply``, but a shard offloaded to its store (no memory: its values are in
    the file) is left as it is when ``fn`` would neither move nor cast it (``model.to("cpu:0")``
    by the Hugging Face Trainer), and refused by name when it would: its values would be read
    from memory it no longer has."""

    def apply(tensor):
        state = evicted.get(id(tensor))
        if state is None:
            return fn(tensor)
        probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        if probe.dtype == tensor.dtype and probe.device == tensor.device:
            return tensor
        raise RuntimeError(
            f"zero3: {state.fqn} is offloaded (shard(offload=Offload(params=...))): this "
            f"module._apply() (model.to(), .half(), ...) would make it {probe.dtype} on "
            f"{probe.device} from {tensor.dtype} on {tensor.device}. Move or cast the model before "
            "zero3.shard, or compute in another dtype with MixedPrecision"
        )

    return apply
