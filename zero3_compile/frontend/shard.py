"""``shard(model)``: every parameter becomes this rank's dim-0 chunk, in place.

Each parameter is replaced by a ``DTensor`` holding this rank's rows (FSDP2's layout: ``Shard(0)``
over the data-parallel mesh) under its original name, so optimizers, ``clip_grad_norm_``,
``state_dict`` and ``torch.distributed.checkpoint`` see ordinary sharded parameters; every module
gets a generated class that reads its parameters in full (``classes.py``). What the call owns (the
mesh, the policy, the cross-rank check, the offload store) is the model's runtime
(``runtime/root.py``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._torch.dtensor import local_tensor
from .._torch.modules import own_parameters
from ..offload.model import Offload, offload_model, open_store, spool_gradients
from ..runtime.guard import DEFAULT_TIMEOUT_S, KIND_EAGER_GATHER, KIND_EAGER_REDUCE, describe
from ..runtime.optimizers import mark_replaced, repoint_optimizers_holding, watch_optimizers
from ..runtime.root import Zero3Runtime
from ..sharding.layout import TensorParallelLayout, model_parallel_mesh, register_mesh_dims
from ..sharding.mesh import DataParallelMesh, group_backend
from ..sharding.state import ModuleState, ShardedParam, param_id_of
from .broadcast import agree_on, broadcast_from, describe_tensors, source_rank
from .classes import is_sharded_module, make_sharded
from .leaves import check_leaf_modules, detected_leaves, set_leaf_modules
from .mixed_precision import MixedPrecision, install_hooks
from .offload_state import install_offload_state_dict_hooks
from .root_unit import install_root_unit

log = logging.getLogger(__name__)


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
    sync_timeout_s: float = DEFAULT_TIMEOUT_S,
    offload: Offload | None = None,
    sync_module_states: bool = True,
) -> nn.Module:
    """Shard every parameter of ``module`` in place along dim 0 over ``group``; return ``module``.

    mesh: instead of ``group``, a device mesh: 1-D (the same as its group), or 2-D with dimensions
        named ``("replicate", "shard")`` for hybrid sharding: parameters are sharded within each
        row of the mesh (a node) and replicated across rows; gathers and reduce-scatters stay
        within a row, and one all-reduce of each reduced gradient shard crosses rows. The mesh
        (or group) may be part of the job (one data-parallel group per pipeline stage): only its
        ranks take part.

    param_dtype, reduce_dtype: mixed precision shorthand for
        ``mp_policy=MixedPrecision(param_dtype, reduce_dtype)`` (see ``MixedPrecision``).
    device: where shards of a model built on the ``meta`` device will live once
        ``zero3_compile.materialize(model)`` allocates them (default: the current CUDA device with
        NCCL, else CPU). Ignored for a model with real parameters.
    leaf_modules: classes or modules whose parameters are gathered together when they are called
        (see ``set_leaf_modules``); modules with a child named ``experts`` always are.
    sync_timeout_s: how long a rank waits for the others at a cross-rank check before raising.
    offload: ``Offload(params="disk" | "cpu", grads="disk" | "cpu", path=...)``: where parameter
        and gradient shards live between uses (see ``zero3_compile.offload``).
    sync_module_states: every rank starts from the first rank of the mesh's parameter and
        buffer values (one broadcast of the model, as DDP and DeepSpeed do), so ranks that
        initialised differently (no common seed) still train one model. Parameters on the
        ``meta`` device are skipped (``materialize`` broadcasts what it initialises). ``False``
        skips the broadcast: only where every rank is known to hold the same values (a huge
        model loaded from one file by every rank).

    An optimizer built over the model's parameters before ``shard`` is re-pointed to the
    sharded parameters (its state sharded with them); so is one built later from parameters
    read as attributes (``[layer.weight]``). Building it after ``shard`` from
    ``model.parameters()`` remains the plainest way.

    Example:
        ```python
        dist.init_process_group()
        model = z3.shard(MyModel())  # every rank starts from rank 0's values
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # the shards
        step_model = torch.compile(model, backend="zero3")
        ```
    """
    _check_can_shard(module)
    policy = _policy(param_dtype, reduce_dtype, mp_policy)
    _check_arguments(group, offload, leaf_modules)
    _check_timeout(sync_timeout_s)
    named = list(module.named_parameters(remove_duplicate=False))
    first_device = named[0][1].device if named else torch.device("cpu")
    requested = _device(device)
    device = _shard_device(first_device, requested, group or dist.group.WORLD)
    dp = DataParallelMesh.resolve(group, mesh, device.type)
    root = Zero3Runtime(dp, policy, device, sync_timeout_s)
    root.sync_module_states = bool(sync_module_states)
    if sync_module_states:
        start_from_first_rank(module, named, dp)
    if offload is not None:
        offload.validate(device)
        root.offload = offload if offload.params is not None else None
    spools_grads = offload is not None and offload.grads is not None
    tp_mesh = model_parallel_mesh(named)
    if tp_mesh is not None:
        register_mesh_dims(tp_mesh)

    canonical = {}  # id(original parameter) -> first name
    for name, param in named:
        canonical.setdefault(id(param), name)
    count = len(named)
    del named  # the originals an optimizer built before shard() still holds: see below
    states: dict[int, ShardedParam] = {}  # id(original parameter) -> state
    owned: list[tuple[str, nn.Module, dict[str, ShardedParam]]] = []
    originals: list[weakref.ref] = []  # parameters replaced by new objects (see shard_parameter)
    for prefix, sub in module.named_modules():
        own = {}
        for attr, param in list(own_parameters(sub).items()):
            if param is None:
                continue
            state = states.get(id(param))
            if state is None:
                state = shard_parameter(param, canonical[id(param)], root, tp_mesh)
                states[id(param)] = state
                if state.param is not param:
                    originals.append(weakref.ref(param))
            state.tied = state.tied or canonical[id(param)] != f"{prefix}.{attr}".lstrip(".")
            own_parameters(sub)[attr] = state.param
            own[attr] = state
        owned.append((prefix, sub, own))
    param = None  # noqa: F841  (no reference of ours keeps an original alive)
    if root.offload is not None:  # before the classes are made: the specs say so
        if first_device.type == "meta":  # filled by materialize() or a loader, shard by shard
            root.offload_store = open_store(root, root.offload, device)
        else:
            offload_model(root, list(states.values()), root.offload, device)
    if spools_grads:
        spool_gradients(root, list(states.values()), offload, device)
    if root.offload is not None or spools_grads:
        for state in states.values():
            state.spec = dp.spec(
                state.fqn,
                state.full_shape,
                policy,
                offloaded=root.offload is not None,
                grads_offloaded=spools_grads,
            )
    for prefix, sub, own in owned:
        make_sharded(sub, ModuleState(params=own, root=root, prefix=prefix))
    install_hooks(module, root)
    install_root_unit(module)
    set_leaf_modules(module, list(leaf_modules or ()) + detected_leaves(module))
    if root.offload is not None:
        install_offload_state_dict_hooks(module)
    watch_optimizers()  # re-points an optimizer holding the originals at its first step
    repoint_optimizers_holding(originals)
    log.debug(
        "[rank %d] zero3: sharded %d parameters (%d unique) over %d ranks",
        dist.get_rank(),
        count,
        len(states),
        dp.shard_size,
    )
    return module


def start_from_first_rank(module: nn.Module, named: list, dp: DataParallelMesh) -> None:
    """The mesh's first rank's values of every parameter and buffer of ``module`` on every rank
    of the mesh (one bucketed broadcast); tensors on ``meta`` are left alone. The ranks check
    first that they hold the same tensors."""
    seen, listed, values = set(), [], []
    for name, tensor in [*named, *module.named_buffers(remove_duplicate=False)]:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        listed.append((name, tensor))
        if tensor.device.type != "meta":
            local = tensor.detach()
            values.append(local_tensor(local) if isinstance(local, DTensor) else local)
    agree_on(dp, describe_tensors(listed), "parameters and buffers at zero3_compile.shard()")
    broadcast_from(values, dp, source_rank(dp, None))


def shard_parameter(
    param: nn.Parameter, fqn: str, root: Zero3Runtime, tp_mesh: DeviceMesh | None = None
) -> ShardedParam:
    """The sharded parameter of ``param``: this rank's rows as the parameter's ``DTensor``.

    Where torch can swap the contents of the user's ``nn.Parameter`` for the ``DTensor`` it
    becomes the sharded parameter itself; where it cannot (a plain ``Parameter`` and a ``DTensor``
    parameter have different layouts: torch 2.13 refuses) the original is marked with its
    replacement, and an optimizer still holding it is re-pointed (``runtime/optimizers.py``). A
    tensor-parallel ``DTensor`` parameter, and beside one (``tp_mesh``) a plain parameter, is laid
    out as [Note: zero3 over tensor parallelism] says.
    """
    if param.dim() == 0:
        raise ValueError(
            f"zero3: parameter {fqn!r} is a 0-dim scalar, which cannot be sharded along dim 0; "
            "store it with shape (1,) (e.g. nn.Parameter(value.reshape(1)))"
        )
    layout = None
    full = param.detach()
    if isinstance(full, DTensor):  # tensor parallelism: shard its local tensor
        layout = TensorParallelLayout.of(fqn, full, root.dp.ranks)
        full = local_tensor(full)
    elif tp_mesh is not None:
        layout = TensorParallelLayout.replicated(tp_mesh, full.shape)
    spec = root.dp.spec(fqn, full.shape, root.policy)
    rank = root.rank
    if full.device.type == "meta":
        local = full.new_empty(spec.local_shape(rank))
    else:
        local = spec.chunk(full, rank)
    sharded = nn.Parameter(root.dp.wrap(local, spec, layout), requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, sharded)
        sharded = param
    except RuntimeError:  # the layouts differ (a plain Parameter and a DTensor): a new object
        mark_replaced(param, sharded)
    state = ShardedParam(
        param_id=param_id_of(fqn, full.shape),
        spec=spec,
        rank=rank,
        param=sharded,
        root=root,
        layout=layout,
    )
    state.attach(sharded)
    # every rank knows every parameter: it can name the peers' eager collectives in an error
    describe(KIND_EAGER_GATHER, state.param_id, repr(fqn), publish=False)
    describe(KIND_EAGER_REDUCE, state.param_id, repr(fqn), publish=False)
    return state


def _policy(param_dtype, reduce_dtype, mp_policy: MixedPrecision | None) -> MixedPrecision:
    if mp_policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(
            "zero3: pass either mp_policy=MixedPrecision(...) or param_dtype/reduce_dtype, not both"
        )
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
        raise TypeError(
            f"zero3: shard(mp_policy=...) must be a z3.MixedPrecision (z3.MixedPrecision("
            f"param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), got {mp_policy!r}"
        )
    policy = mp_policy or MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy.validate()
    return policy


def _check_arguments(group, offload, leaf_modules) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"zero3: shard(group=...) must be a torch.distributed ProcessGroup (dist.new_group(...)), "
            f"got {type(group).__name__}"
        )
    if offload is not None and not isinstance(offload, Offload):
        raise TypeError(
            f"zero3: shard(offload=...) must be a z3.Offload (z3.Offload(params='disk', "
            f"path=...)), got {offload!r}"
        )
    check_leaf_modules(leaf_modules)


def _check_timeout(timeout_s) -> None:
    if not (
        isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0
    ):
        raise ValueError(
            f"zero3: shard(sync_timeout_s=...) must be a positive number of seconds, got "
            f"{timeout_s!r}"
        )


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


def _device(device) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"zero3: shard(device={device!r}) is not a device: {error}") from error


def _shard_device(param_device: torch.device, requested, group) -> torch.device:
    """The device shards live on: the parameters', or for meta parameters the requested one."""
    if param_device.type != "meta":
        return param_device
    if requested is not None:
        return requested
    if group_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
