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
- the methods of the generated classes come from a registry (``register_methods``) that the
  modules defining them fill when they are imported (``frontend/__init__.py`` imports them all):
  ``__setattr__`` / ``register_parameter`` (``assignment.py``: a parameter or module assigned
  after ``shard()`` is sharded on assignment; assigning a sharded parameter ties it), ``_apply``
  (``apply.py``: ``model.to()``, ``.half()``, ``.float()`` work on the shards), ``__reduce_ex__``
  (``pickling.py``: ``torch.save(model)`` and ``copy.deepcopy(model)`` rebuild a sharded model),
  and for recurrent modules (``rnn.py``) weights read through the getters for one forward at a
  time instead of full copies cached in ``_flat_weights``. This module imports none of them:
  imports inside ``frontend/`` go one way.

The class name stays the original's, so code that looks at ``type(m).__name__`` sees no change.
Generated classes are shared by modules with the same base class and the same parameter specs
but for the names (the same layer of every block, of every instance of a model), so dynamo
reuses compiled code across them.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .._torch.dtensor import local_shard
from .._torch.modules import own_parameters
from ..sharding.spec import UNBOUND_ID
from ..sharding.state import ModuleState, ShardedParam, ShardState, module_state, set_module_state
from .module import Zero3Module

BASE = "_zero3_base_class"

_classes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# (base classes they apply to, attributes) of the generated classes, in registration order
_methods: list[tuple[type, dict]] = []
_generated = False  # a class was generated: the registry is complete


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


def register_methods(methods: dict, *, applies_to: type = nn.Module) -> None:
    """Give every generated class whose base class is a subclass of ``applies_to`` these
    attributes (methods, properties); called once by each module defining some, at import,
    before any class is generated.

    Example:
        ```python
        register_methods({"_apply": apply_})  # apply.py: every sharded module
        register_methods(RNN_METHODS, applies_to=nn.RNNBase)  # rnn.py: recurrent modules only
        ```
    """
    if _generated:
        raise RuntimeError(
            "zero3: register_methods() after a generated class was built; import the module "
            "that registers methods with zero3_compile.frontend (frontend/__init__.py)"
        )
    _methods.append((applies_to, dict(methods)))


def class_namespace(base: type) -> dict:
    """The methods every generated class of ``base`` has (parameter properties aside)."""
    namespace = {
        BASE: base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    for applies_to, methods in _methods:
        if issubclass(base, applies_to):
            namespace.update(methods)
    return namespace


def generated_class(base: type, namespace: dict) -> type:
    global _generated
    _generated = True
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
        f"            if not own_parameters(self)[{attr!r}].requires_grad:\n"
        "                kept = kept.detach()\n"
        f"            return {tp(kept_expr)}\n"
        "        if mode is GATHERED:\n"
        f"            return {tp('param_state.kept_full')}\n"
        "        if mode is LOADING:\n"
        f"            return own_parameters(self)[{attr!r}]\n"
        f"        if own_parameters(self)[{attr!r}].requires_grad:\n"
        "            sink = param_state.grad_sink\n"
        "    if is_compiling():\n"
        f"        shard = own_parameters(self)[{attr!r}].to_local()\n"
        f"        full = unshard(shard, {UNBOUND_ID}, {state.spec.unbound_literal()!r}, sink)\n"
        f"        return {tp('full')}\n"
        f"    shard = local_shard(own_parameters(self)[{attr!r}])\n"
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
        "own_parameters": own_parameters,
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
