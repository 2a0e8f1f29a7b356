"""Parameter sharding and the module class swap.

``shard(model)`` replaces every parameter by a ``DTensor`` with placement ``Shard(0)`` holding this
rank's 1/N chunk (FSDP2's layout), under its original name, so optimizers, ``clip_grad_norm_``,
``state_dict`` and ``torch.distributed.checkpoint`` see ordinary sharded parameters.

Every module of the model gets a class of its own, a subclass of its class generated for it:

- one property per parameter name: reading ``module.weight`` returns the full tensor through the
  differentiable ``zero3::unshard`` operation, so unmodified forward code runs, eagerly or under
  ``torch.compile``. The getter is generated from ``MarkerArgs`` with the values as literals:
  read from a closure or an attribute, dynamo would treat the shape integers as inputs and, on a
  recompile, make them symbolic; literals are constants of the code.
- ``__setattr__`` / ``register_parameter``: a parameter (or a module holding parameters) assigned
  after ``shard()`` is sharded on assignment; assigning a sharded parameter ties it.
- ``_apply``: ``model.to()``, ``.half()``, ``.float()`` work on the shards and re-attach the state.
- ``__reduce_ex__``: ``torch.save(model)`` and ``copy.deepcopy(model)`` rebuild a sharded model
  (with parameters of its own identity) instead of failing on an unimportable class.
- recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) read their weights through the getters
  for the length of one forward instead of caching full copies in ``_flat_weights``.

The class name stays the original's, so code that looks at ``type(m).__name__`` sees no change.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import guard
from .compat import group_backend, mesh_from_group
from .mixed_precision import MixedPrecision, install_hooks
from .offload.params import Offload, loaded, offload_model, offloaded_states
from .param import (
    ModuleState,
    ShardedParam,
    ShardRoot,
    is_sharded,
    module_state,
    param_id_of,
    set_module_state,
    state_of,
)

log = logging.getLogger(__name__)

_BASE = "_zero3_base_class"


def is_sharded_module(module: nn.Module) -> bool:
    return module_state(module) is not None


def base_class(module: nn.Module) -> type:
    """The module's class as the user defined it (before the swap)."""
    cls = type(module)
    return cls.__dict__.get(_BASE, cls)


def shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    mp_policy: MixedPrecision | None = None,
    device: torch.device | str | None = None,
    leaf_modules: Iterable[type | nn.Module] | None = None,
    sync_timeout_s: float = guard.DEFAULT_TIMEOUT_S,
    offload: Offload | None = None,
) -> nn.Module:
    """Shard every parameter of ``module`` in place along dim 0 over ``group``; return ``module``.

    mesh: instead of ``group``, a device mesh: 1-D (the same as its group), or 2-D with dimensions
        named ``("replicate", "shard")`` for hybrid sharding: parameters are sharded within each
        row of the mesh (a node) and replicated across rows; gathers and reduce-scatters stay
        within a row, and one all-reduce of each reduced gradient shard crosses rows.

    param_dtype, reduce_dtype: mixed precision shorthand for
        ``mp_policy=MixedPrecision(param_dtype, reduce_dtype)`` (see ``MixedPrecision``).
    device: where shards of a model built on the ``meta`` device will live once
        ``zero3_compile.materialize(model)`` allocates them (default: the current CUDA device with
        NCCL, else CPU). Ignored for a model with real parameters.
    leaf_modules: classes or modules whose parameters are gathered together when they are called
        (see ``set_leaf_modules``); modules with a child named ``experts`` always are.
    sync_timeout_s: how long a rank waits for the others at a cross-rank check before raising.
    offload: ``Offload(params="disk" | "cpu", path=...)``: where parameter shards live between
        uses (see ``zero3_compile.offload``).
    """
    policy = _policy(param_dtype, reduce_dtype, mp_policy)
    _check_can_shard(module)
    group, replicate_group, placements = _groups(group, mesh)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    named = list(module.named_parameters(remove_duplicate=False))
    first_device = named[0][1].device if named else torch.device("cpu")
    device = _shard_device(first_device, device, group)
    if mesh is None:
        mesh = mesh_from_group(group, device.type)
    _register_guards(group, replicate_group, sync_timeout_s)
    root = ShardRoot(group, mesh, policy, world_size, rank, device)
    root.replicate_group = replicate_group
    root.placements = placements
    if offload is not None and offload.params is not None:
        offload.validate(device)
        root.offload = offload

    canonical = {}  # id(original parameter) -> first name
    for name, param in named:
        canonical.setdefault(id(param), name)
    states: dict[int, ShardedParam] = {}  # id(original parameter) -> state
    owned: list[tuple[str, nn.Module, dict[str, ShardedParam]]] = []
    for prefix, sub in module.named_modules():
        own = {}
        for attr, param in list(sub._parameters.items()):
            if param is None:
                continue
            state = states.get(id(param))
            if state is None:
                state = _shard_parameter(param, canonical[id(param)], root)
                states[id(param)] = state
            sub._parameters[attr] = state.param
            own[attr] = state
        owned.append((prefix, sub, own))
    offloading = root.offload is not None and named and named[0][1].device.type != "meta"
    if offloading:  # before the classes are made: the markers say the shards are offloaded
        offload_model(root, list(states.values()), root.offload, device)
    for prefix, sub, own in owned:
        _make_sharded(sub, ModuleState(params=own, root=root, prefix=prefix))
    install_hooks(module, policy)
    set_leaf_modules(module, list(leaf_modules or ()) + _detected_leaves(module))
    if offloading:
        _install_offload_state_dict_hooks(module)
    log.debug(
        "[rank %d] zero3: sharded %d parameters (%d unique) over %d ranks",
        rank,
        len(named),
        len(states),
        world_size,
    )
    return module


def _groups(group, mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, tuple]:
    """(the group to shard over, the replicate group or None, the parameters' placements)."""
    if mesh is None:
        return (group if group is not None else dist.group.WORLD), None, (Shard(0),)
    if group is not None:
        raise ValueError("zero3: pass either group= or mesh= to shard(), not both")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"zero3: mesh= must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"zero3: the mesh has {mesh.size()} ranks but the job has {dist.get_world_size()}; "
            "build it over every rank: init_device_mesh(device, (nodes, ranks_per_node), "
            "mesh_dim_names=('replicate', 'shard'))"
        )
    if mesh.ndim == 1:
        return mesh.get_group(), None, (Shard(0),)
    names = mesh.mesh_dim_names or ()
    roles = [_role(name) for name in names]
    if mesh.ndim != 2 or sorted(roles) != ["replicate", "shard"]:
        raise ValueError(
            f"zero3: shard(mesh=...) takes a 1-D mesh or a 2-D mesh whose dimensions are named "
            f"('replicate', 'shard'); got {mesh.ndim} dimension(s) named {names}. Build it with "
            "init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', "
            "'shard')) (more dimensions, for tensor parallelism, are not supported)"
        )
    shard_name = names[roles.index("shard")]
    replicate_name = names[roles.index("replicate")]
    placements = tuple(Shard(0) if r == "shard" else Replicate() for r in roles)
    return mesh[shard_name].get_group(), mesh[replicate_name].get_group(), placements


def _role(name: str | None) -> str | None:
    if name in ("shard", "dp_shard"):
        return "shard"
    if name in ("replicate", "dp_replicate"):
        return "replicate"
    return None


def _register_guards(group, replicate_group, timeout_s: float) -> None:
    """The side groups of the cross-rank check. With hybrid sharding the check spans every rank
    (a row's collectives and the all-reduce across rows must agree), and group names, which
    differ from row to row, are compared by their role."""
    if replicate_group is None:
        guard.register_group(group, timeout_s)
        return
    world = dist.group.WORLD
    guard.register_group(world, timeout_s)
    guard.alias(group, world, role="shard")
    guard.alias(replicate_group, world, role="replicate")


def _policy(param_dtype, reduce_dtype, mp_policy: MixedPrecision | None) -> MixedPrecision:
    if mp_policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(
            "zero3: pass either mp_policy=MixedPrecision(...) or param_dtype/reduce_dtype, not both"
        )
    policy = mp_policy or MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy.validate()
    return policy


def _check_can_shard(module: nn.Module) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zero3: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() (launch with torchrun, or set "
            "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) before zero3_compile.shard(model)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"zero3: shard() expects an nn.Module, got {type(module).__name__}")
    for name, sub in module.named_modules():
        if is_sharded_module(sub):
            raise ValueError(
                f"zero3: the model is already sharded (module {name or '<root>'!r}); call "
                "zero3_compile.shard(model) once per model"
            )
    named = list(module.named_parameters(remove_duplicate=False))
    for name, param in named:
        if isinstance(param, DTensor):
            raise ValueError(
                f"zero3: parameter {name!r} is already a DTensor (sharded by another tool such as "
                "FSDP2 or tensor parallelism); zero3_compile.shard expects plain parameters"
            )
        if param.dim() == 0:
            raise ValueError(
                f"zero3: parameter {name!r} is a 0-dim scalar, which cannot be sharded along dim 0; "
                "store it with shape (1,) (e.g. nn.Parameter(value.reshape(1)))"
            )
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        where = {d: next(n for n, p in named if str(p.device) == d) for d in devices}
        raise ValueError(
            f"zero3: parameters are on different devices {where}; move the whole model to one "
            "device (model.to(device)) before zero3_compile.shard(model)"
        )


def _shard_device(param_device: torch.device, requested, group) -> torch.device:
    """The device shards live on: the parameters', or for meta parameters the requested one."""
    if param_device.type != "meta":
        return param_device
    if requested is not None:
        return torch.device(requested)
    if group_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard_parameter(param: nn.Parameter, fqn: str, root: ShardRoot) -> ShardedParam:
    """The sharded parameter of ``param``: this rank's ``torch.chunk`` rows as a Shard(0) DTensor.

    The user's ``nn.Parameter`` object itself becomes the sharded parameter (its contents are
    swapped), so references held elsewhere (an optimizer built too early) stay valid.
    """
    if param.dim() == 0:
        raise ValueError(
            f"zero3: parameter {fqn!r} is a 0-dim scalar, which cannot be sharded along dim 0; "
            "store it with shape (1,) (e.g. nn.Parameter(value.reshape(1)))"
        )
    full = param.detach()
    chunks = torch.chunk(full, root.world_size, dim=0)
    if root.rank < len(chunks):
        local = chunks[root.rank].clone(memory_format=torch.contiguous_format)
    else:
        local = full.new_empty((0, *full.shape[1:]))
    dtensor = DTensor.from_local(
        local,
        root.mesh,
        list(root.placements),
        run_check=False,
        shape=full.shape,
        stride=_contiguous_stride(full.shape),
    )
    sharded = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, sharded)
        sharded = param
    except RuntimeError:  # a weak reference to the original (rare): keep the new object
        pass
    state = ShardedParam(
        param_id=param_id_of(fqn, full.shape),
        fqn=fqn,
        full_shape=tuple(full.shape),
        group_name=root.group.group_name,
        world_size=root.world_size,
        rank=root.rank,
        policy=root.policy,
        param=sharded,
        replicate_group="" if root.replicate_group is None else root.replicate_group.group_name,
        replicate_size=root.replicate_size,
    )
    state.attach(sharded)
    # every rank knows every parameter: name the peers' eager collectives without the store
    code = state.param_id
    guard.describe(guard.KIND_EAGER_GATHER, code, repr(fqn), publish=False)
    guard.describe(guard.KIND_EAGER_REDUCE, code, repr(fqn), publish=False)
    return state


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


# --------------------------------------------------------------------------- the class swap


# Generated classes are shared by modules with the same base class and the same parameter
# markers (the same layer of two instances of a model), so dynamo reuses compiled code across
# them; a class lives as long as a module uses it.
_classes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _make_sharded(module: nn.Module, state: ModuleState) -> None:
    set_module_state(module, state)
    if isinstance(module, nn.RNNBase):
        module.__dict__.pop("_flat_weights", None)  # full copies of the original weights
        module.__dict__["_flat_weight_refs"] = []
    _reclass(module)


def _reclass(module: nn.Module) -> None:
    """Give ``module`` the generated class matching its base class and its parameters."""
    base = base_class(module)
    params = module_state(module).params
    key = (base, tuple(sorted((attr, state.marker.literal()) for attr, state in params.items())))
    cls = _classes.get(key)
    if cls is None:
        namespace = {
            _BASE: base,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__setattr__": _setattr,
            "register_parameter": _register_parameter,
            "_apply": _apply,
            "__reduce_ex__": _reduce_ex,
        }
        if issubclass(base, nn.RNNBase):
            namespace.update(_RNN_METHODS)
        for attr, state in params.items():
            namespace[attr] = property(_make_getter(attr, state))
        cls = type(base.__name__, (base,), namespace)
        _classes[key] = cls
    module.__class__ = cls


def _make_getter(attr: str, state: ShardedParam):
    """The property getter of one parameter: ``unshard`` of its local shard.

    Inside a leaf module's forward the full parameter was gathered with the whole block; while
    gradient sync is off the full gradient goes to the parameter's sink instead of a collective,
    or the parameter kept gathered is read (``keep_gathered``, accumulation.py).
    Eager reads return a ``GatheredParameter`` that writes in-place changes back to the shard.
    """
    param_dtype = state.policy.param_dtype
    # kept gathered in the shard's dtype (accumulation.py); computed with in param_dtype
    kept_expr = "kept" if param_dtype is None else f"kept.to({param_dtype!r})"
    source = (
        "def get_full_parameter(self):\n"
        "    module_state = self.__dict__['_zero3']\n"
        "    scope = module_state.scope\n"
        f"    if scope is not None and {attr!r} in scope:\n"
        f"        return scope[{attr!r}]\n"
        "    sink = None\n"
        "    if not module_state.requires_sync:\n"
        f"        kept = module_state.kept({attr!r})\n"
        "        if kept is not None:\n"
        f"            return {kept_expr}\n"
        f"        sink = module_state.sink({attr!r})\n"
        f"    shard = self._parameters[{attr!r}].to_local()\n"
        f"    full = unshard(shard, {state.marker.literal()}, sink)\n"
        "    if is_compiling():\n"
        "        return full\n"
        f"    return gathered_parameter(full, module_state.params[{attr!r}])\n"
    )
    from .write_through import gathered_parameter

    namespace = {
        "unshard": torch.ops.zero3.unshard.default,
        "is_compiling": torch.compiler.is_compiling,
        "gathered_parameter": gathered_parameter,
        "torch": torch,
    }
    exec(compile(source, f"<zero3 parameter {state.fqn}>", "exec"), namespace)
    return namespace["get_full_parameter"]


def _base_call(module: nn.Module, name: str, *args):
    return getattr(type(module).__dict__[_BASE], name)(module, *args)


def _setattr(self: nn.Module, name: str, value) -> None:
    from .write_through import GatheredParameter

    if isinstance(value, GatheredParameter) and tuple(value.shape) == value.sharded_shape():
        # ``a.weight = b.weight`` ties: reading b.weight gave b's parameter as a full tensor
        value = value._zero3_link.state.param
    if isinstance(value, nn.Module) and not isinstance(value, nn.Parameter):
        if any(not is_sharded_module(m) for m in value.modules()):
            _shard_submodule(self, name, value)
    _base_call(self, "__setattr__", name, value)
    if name in self.__dict__.get("_parameters", {}) and value is None:
        if module_state(self).params.pop(name, None) is not None:
            _reclass(self)


def _register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    state = module_state(self)
    if param is not None and not is_sharded(param):
        if isinstance(param, DTensor):
            raise ValueError(
                f"zero3: cannot assign a DTensor parameter to {state.prefix or '<root>'}.{name}; "
                "assign a plain nn.Parameter (it is sharded on assignment)"
            )
        fqn = f"{state.prefix}.{name}" if state.prefix else name
        param = _shard_parameter(param, fqn, state.root).param
    _base_call(self, "register_parameter", name, param)
    if param is None:
        state.params.pop(name, None)
    else:
        state.params[name] = state_of(param)
    _reclass(self)


def _shard_submodule(parent: nn.Module, name: str, child: nn.Module) -> None:
    """A module assigned into a sharded model after ``shard()``: shard it the same way."""
    state = module_state(parent)
    root = state.root
    prefix = f"{state.prefix}.{name}" if state.prefix else name
    named = list(child.named_parameters(remove_duplicate=False))
    canonical = {}
    for sub_name, param in named:
        canonical.setdefault(id(param), f"{prefix}.{sub_name}")
    states: dict[int, ShardedParam] = {}
    for sub_prefix, sub in child.named_modules():
        if is_sharded_module(sub):
            continue
        own = {}
        for attr, param in list(sub._parameters.items()):
            if param is None:
                continue
            shared = state_of(param) or states.get(id(param))
            if shared is None:
                shared = _shard_parameter(param, canonical[id(param)], root)
                states[id(param)] = shared
            sub._parameters[attr] = shared.param
            own[attr] = shared
        full_prefix = f"{prefix}.{sub_prefix}" if sub_prefix else prefix
        _make_sharded(sub, ModuleState(params=own, root=root, prefix=full_prefix))


def _apply(self: nn.Module, fn, recurse: bool = True):
    """``model.to()`` and friends: apply ``fn`` to the shards, re-attach the parameters' states
    (``swap_tensors`` replaced their contents and attributes)."""
    result = _base_call(self, "_apply", fn, recurse)
    for attr, state in module_state(self).params.items():
        param = self._parameters.get(attr)
        if param is None:
            continue
        if not isinstance(param, DTensor) or tuple(param.shape) != state.full_shape:
            raise RuntimeError(
                f"zero3: {state.fqn} is no longer a sharded parameter of shape "
                f"{state.full_shape} after module._apply(); only dtype and device changes are "
                "supported on a sharded model"
            )
        state.attach(param)
    return result


# --------------------------------------------------------------------------- pickling


def _reduce_ex(self: nn.Module, protocol):
    base = type(self).__dict__[_BASE]
    state = dict(self.__dict__)
    module = module_state(self)
    info = (module.requires_sync, module.prefix, module.root)
    state.pop("_zero3", None)
    return (_rebuild_module, (base, info), state)


def _rebuild_module(base: type, info) -> nn.Module:
    """The first half of unpickling a sharded module: an empty instance of a generated class
    whose ``__setstate__`` re-attaches fresh parameter states (new ids) once the contents are in."""
    module = base.__new__(base)
    requires_sync, prefix, root = info
    state = ModuleState(requires_sync=requires_sync, prefix=prefix, root=root)
    set_module_state(module, state)
    namespace = {
        _BASE: base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__setattr__": _setattr,
        "register_parameter": _register_parameter,
        "_apply": _apply,
        "__reduce_ex__": _reduce_ex,
        "__setstate__": _setstate,
    }
    if issubclass(base, nn.RNNBase):
        namespace.update(_RNN_METHODS)
    module.__class__ = type(base.__name__, (base,), namespace)
    return module


def _setstate(self: nn.Module, state: dict) -> None:
    own = module_state(self)
    base = type(self).__dict__[_BASE]
    base.__setstate__(self, state) if hasattr(base, "__setstate__") else self.__dict__.update(state)
    set_module_state(self, own)
    self.__dict__.pop("_flat_weights", None)
    for attr, param in self._parameters.items():
        if param is not None:
            own.params[attr] = _unpickled_state(param, own, attr)
    _reclass(self)


def _unpickled_state(param: nn.Parameter, module: ModuleState, attr: str) -> ShardedParam:
    state = state_of(param)
    if state is not None:  # tied: another module of this model re-attached it already
        return state
    root = module.root
    mesh = param.device_mesh
    fqn = f"{module.prefix}.{attr}" if module.prefix else attr
    state = ShardedParam(
        param_id=param_id_of(fqn, param.shape),
        fqn=fqn,
        full_shape=tuple(param.shape),
        group_name=mesh.get_group().group_name,
        world_size=mesh.size(),
        rank=mesh.get_local_rank(),
        policy=root.policy if root is not None else MixedPrecision(),
        param=param,
    )
    state.attach(param)
    return state


# --------------------------------------------------------------------------- recurrent modules


def _rnn_flat_weights(self):
    bound = self.__dict__.get("_zero3_flat")
    if bound is not None:
        return bound
    return [
        getattr(self, wn) if self._parameters.get(wn) is not None else None
        for wn in self._flat_weights_names
    ]


def _rnn_forward(self, *args, **kwargs):
    # gather each weight once for this forward, drop the full copies when it ends
    self.__dict__["_zero3_flat"] = _rnn_flat_weights(self)
    try:
        return type(self).__dict__[_BASE].forward(self, *args, **kwargs)
    finally:
        self.__dict__["_zero3_flat"] = None


def _rnn_noop(self, *args, **kwargs) -> None:
    return None


def _rnn_init_flat_weights(self) -> None:
    self.__dict__["_flat_weight_refs"] = []


_RNN_METHODS = {
    "_flat_weights": property(_rnn_flat_weights, _rnn_noop),
    "forward": _rnn_forward,
    "_init_flat_weights": _rnn_init_flat_weights,
    "_update_flat_weights": _rnn_noop,
    "flatten_parameters": _rnn_noop,
    "_weights_have_changed": lambda self: False,
}


# --------------------------------------------------------------------------- leaf modules


def set_leaf_modules(model: nn.Module, modules: Iterable[type | nn.Module]) -> list[nn.Module]:
    """Gather the parameters of each given module (and of all its descendants) together, once,
    when it is called, on every rank, whichever of them its forward then reads.

    For blocks whose parameter reads depend on the data, a mixture-of-experts layer looping over
    the experts that received tokens: without it, each rank would gather the experts it uses and
    the ranks' collectives would differ. ``modules`` are classes (every instance in ``model``) or
    module instances. Modules with a child named ``experts`` are leaves already. Returns the leaf
    modules of ``model``.

    Their full parameters stay alive for the block's whole forward (and, eagerly, until its
    backward), as with DeepSpeed's leaf modules.
    """
    wanted_types = tuple(m for m in modules if isinstance(m, type))
    wanted_ids = {id(m) for m in modules if isinstance(m, nn.Module)}
    leaves = []
    for sub in model.modules():
        if not (isinstance(sub, wanted_types) or id(sub) in wanted_ids):
            continue
        state = module_state(sub)
        if state is None:
            raise ValueError(
                f"zero3: set_leaf_modules needs a sharded model; call zero3_compile.shard(model) "
                f"first ({type(sub).__name__} is not sharded)"
            )
        leaves.append(sub)
        if any(ref() is sub for ref in state.root.leaves):
            continue
        state.root.leaves.append(weakref.ref(sub))
        members = [
            (module_state(owner), attr, owner)
            for owner in sub.modules()
            for attr in module_state(owner).params
        ]
        sub.register_forward_pre_hook(_leaf_enter(members))
        sub.register_forward_hook(_leaf_exit(members), always_call=True)
    return leaves


def _detected_leaves(model: nn.Module) -> list[nn.Module]:
    """Mixture-of-experts blocks: modules with a child named ``experts`` (Mixtral, Qwen2-MoE,
    DeepSeek, OLMoE, Switch, and most hand-written ones)."""
    return [m for m in model.modules() if "experts" in m._modules]


def _leaf_enter(members):
    def enter(module, args):
        if any(state.scope is not None for state, _, _ in members):
            return  # inside an enclosing leaf: gathered already
        if torch.compiler.is_compiling() or not all(s.requires_sync for s, _, _ in members):
            # traced: the passes bucket the markers; sync off: each gradient goes to its sink
            fulls = [getattr(owner, attr) for _, attr, owner in members]
        else:
            fulls = _gather_eagerly(members)
        for (state, attr, _), full in zip(members, fulls):
            if state.scope is None:
                state.scope = {}
            state.scope[attr] = full

    return enter


def _leaf_exit(members):
    def exit_(module, args, output):
        for state, _, _ in members:
            state.scope = None

    return exit_


def _gather_eagerly(members) -> list[torch.Tensor]:
    from .ops import UnshardMany
    from .write_through import gathered_parameter

    unique: dict[int, ShardedParam] = {}
    for state, attr, _ in members:
        param_state = state.params[attr]
        unique.setdefault(id(param_state), param_state)
    params = list(unique.values())
    fulls = UnshardMany.apply(tuple(p.marker for p in params), *[p.local() for p in params])
    by_state = {id(p): gathered_parameter(f, p) for p, f in zip(params, fulls)}
    return [by_state[id(state.params[attr])] for state, attr, _ in members]


# --------------------------------------------------------------------------- offloaded shards


def _install_offload_state_dict_hooks(model: nn.Module) -> None:
    """``state_dict()`` returns loaded copies of offloaded shards; ``load_state_dict()`` loads
    them, copies in, and stores the new values (DCP goes through both)."""
    for module in model.modules():
        state = module_state(module)
        if state is None or not any(p.offload is not None for p in state.params.values()):
            continue
        module.register_state_dict_post_hook(_state_dict_copies)
        module._register_load_state_dict_pre_hook(_load_into_offloaded, with_module=True)
    model.register_load_state_dict_post_hook(_store_after_load)


def _state_dict_copies(module, state_dict, prefix, local_metadata) -> None:
    for attr, param_state in module_state(module).params.items():
        key = prefix + attr
        if param_state.offload is None or key not in state_dict:
            continue
        with loaded([param_state], write_back=False):
            local = param_state.local().clone()
        param = param_state.param
        state_dict[key] = DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )


_pending_loads: list = []


def _load_into_offloaded(module, state_dict, prefix, *args) -> None:
    from .offload.params import load_shards

    states = [p for p in module_state(module).params.values() if p.offload is not None]
    load_shards(states)
    _pending_loads.extend(states)


def _store_after_load(module, incompatible_keys) -> None:
    from .offload.params import store_shards

    states = list({id(s): s for s in _pending_loads}.values())
    _pending_loads.clear()
    store_shards(states)


def offloaded_parameters_loaded(model: nn.Module, *, write_back: bool = False):
    """Context manager: the model's offloaded shards in memory for the ``with`` block."""
    return loaded(offloaded_states(model), write_back=write_back)
