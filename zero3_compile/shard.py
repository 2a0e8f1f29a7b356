"""Parameter sharding and the module class swap.

``shard(model)`` replaces every parameter by a ``DTensor`` with placement ``Shard(0)`` holding this
rank's 1/N chunk (FSDP2's layout), under its original name, so optimizers, ``clip_grad_norm_``,
``state_dict`` and ``torch.distributed.checkpoint`` see ordinary sharded parameters. Each module
owning parameters gets a cached subclass with one property per parameter name: reading
``module.weight`` returns the full tensor through the differentiable ``zero3::unshard`` operation,
so unmodified forward code runs, eagerly or under ``torch.compile``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from .compat import group_backend, mesh_from_group
from .mixed_precision import MixedPrecision, install_hooks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParamSpec:
    """Static facts about one sharded parameter (the same on every rank)."""

    name: str  # canonical fully qualified name (the first one, for tied parameters)
    full_shape: tuple[int, ...]
    group_name: str
    world_size: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None


_SPECS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # sharded nn.Parameter -> ParamSpec
_CLASS_CACHE: dict[tuple, type] = {}


def is_sharded(param: torch.Tensor) -> bool:
    return param in _SPECS


def spec_of(param: torch.Tensor) -> ParamSpec | None:
    return _SPECS.get(param)


def _make_getter(attr: str, spec: ParamSpec):
    """The property getter of one parameter: ``unshard`` of its local shard.

    The getter is generated with the spec's values as literals: read from a closure or an
    attribute, dynamo would treat the shape integers as inputs, and on a recompile mark them
    dynamic (symbolic full shapes); literals are constants of the code. While gradient sync is
    off (``set_requires_gradient_sync``) the full gradient goes to the parameter's sink instead.
    """
    args = (
        f"{list(spec.full_shape)!r}, {spec.group_name!r}, {spec.world_size}, "
        f"{_literal(spec.param_dtype)}, {_literal(spec.reduce_dtype)}, {spec.name!r}"
    )
    source = (
        "def get_full_parameter(self):\n"
        f"    shard = self._parameters[{attr!r}].to_local()\n"
        "    if self._zero3_sync:\n"
        f"        return torch.ops.zero3.unshard(shard, {args})\n"
        f"    return torch.ops.zero3.unshard(shard, {args}, self._zero3_sinks[{attr!r}])\n"
    )
    namespace = {"torch": torch}
    exec(compile(source, f"<zero3 parameter {spec.name}>", "exec"), namespace)
    return namespace["get_full_parameter"]


def _literal(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype)  # "torch.bfloat16"


def _swap_class(module: nn.Module, specs: dict[str, ParamSpec]) -> None:
    base = type(module)
    key = (base, tuple(sorted(specs.items(), key=lambda kv: kv[0])))
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        attrs = {attr: property(_make_getter(attr, spec)) for attr, spec in specs.items()}
        attrs["_zero3_base_class"] = base
        attrs["_zero3_sync"] = True  # see accumulation.set_requires_gradient_sync
        attrs["_zero3_sinks"] = None
        attrs["__module__"] = base.__module__
        cls = type(f"Zero3{base.__name__}", (base,), attrs)
        _CLASS_CACHE[key] = cls
    module.__class__ = cls


def _check_can_shard(module: nn.Module) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zero3: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() (launch with torchrun, or set "
            "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE) before zero3_compile.shard(model)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"zero3: shard() expects an nn.Module, got {type(module).__name__}")
    named = list(module.named_parameters(remove_duplicate=False))
    for name, param in named:
        if is_sharded(param) or hasattr(type(_owner(module, name)), "_zero3_base_class"):
            raise ValueError(
                f"zero3: the model is already sharded (parameter {name!r}); call "
                "zero3_compile.shard(model) once per model"
            )
        if isinstance(param, DTensor):
            raise ValueError(
                f"zero3: parameter {name!r} is already a DTensor (sharded by another tool such as "
                "FSDP2 or tensor parallelism); zero3_compile.shard expects plain parameters"
            )
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        where = {d: next(n for n, p in named if str(p.device) == d) for d in devices}
        raise ValueError(
            f"zero3: parameters are on different devices {where}; move the whole model to one "
            "device (model.to(device)) before zero3_compile.shard(model)"
        )
    for name, param in named:
        if param.dim() == 0:
            raise ValueError(
                f"zero3: parameter {name!r} is a 0-dim scalar, which cannot be sharded along dim 0; "
                "store it with shape (1,) (e.g. nn.Parameter(value.reshape(1)))"
            )


def _owner(root: nn.Module, qualified_name: str) -> nn.Module:
    module_path, _, _ = qualified_name.rpartition(".")
    return root.get_submodule(module_path) if module_path else root


def shard(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    mp_policy: MixedPrecision | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Shard every parameter of ``module`` in place along dim 0 over ``group``; return ``module``.

    param_dtype, reduce_dtype: mixed precision shorthand for
        ``mp_policy=MixedPrecision(param_dtype, reduce_dtype)`` (see ``MixedPrecision``).
    device: where shards of a model built on the ``meta`` device will live once
        ``zero3_compile.materialize(model)`` allocates them (default: the current CUDA device with
        NCCL, else CPU). Ignored for a model with real parameters.
    """
    policy = _policy(param_dtype, reduce_dtype, mp_policy)
    _check_can_shard(module)
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    named = list(module.named_parameters(remove_duplicate=False))
    if not named:
        return module
    device = _shard_device(named[0][1].device, device, group)
    mesh = mesh_from_group(group, device.type)

    sharded: dict[int, nn.Parameter] = {}  # id(original parameter) -> sharded parameter
    owners: dict[nn.Module, dict[str, ParamSpec]] = {}
    for name, param in named:
        owner = _owner(module, name)
        attr = name.rpartition(".")[2]
        new = sharded.get(id(param))
        if new is None:
            spec = ParamSpec(
                name=name,
                full_shape=tuple(param.shape),
                group_name=group.group_name,
                world_size=world_size,
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.reduce_dtype,
            )
            new = _shard_parameter(param, spec, mesh, rank)
            sharded[id(param)] = new
            _SPECS[new] = spec
        owner._parameters[attr] = new
        owners.setdefault(owner, {})[attr] = _SPECS[new]
    for owner, specs in owners.items():
        _swap_class(owner, specs)
    install_hooks(module, policy)
    log.debug(
        "[rank %d] zero3: sharded %d parameters (%d unique) over %d ranks",
        rank,
        len(named),
        len(sharded),
        world_size,
    )
    return module


def _policy(param_dtype, reduce_dtype, mp_policy: MixedPrecision | None) -> MixedPrecision:
    if mp_policy is not None and (param_dtype is not None or reduce_dtype is not None):
        raise ValueError(
            "zero3: pass either mp_policy=MixedPrecision(...) or param_dtype/reduce_dtype, not both"
        )
    policy = mp_policy or MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy.validate()
    return policy


def _shard_device(param_device: torch.device, requested, group) -> torch.device:
    """The device shards live on: the parameters', or for meta parameters the requested one."""
    if param_device.type != "meta":
        return param_device
    if requested is not None:
        return torch.device(requested)
    if group_backend(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard_parameter(param: nn.Parameter, spec: ParamSpec, mesh, rank: int) -> nn.Parameter:
    full = param.detach()
    chunks = torch.chunk(full, spec.world_size, dim=0)
    if rank < len(chunks):
        local = chunks[rank].clone(memory_format=torch.contiguous_format)
    else:
        local = full.new_empty((0, *full.shape[1:]))
    dtensor = DTensor.from_local(
        local,
        mesh,
        [Shard(0)],
        run_check=False,
        shape=full.shape,
        stride=_contiguous_stride(full.shape),
    )
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def sharded_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter, ParamSpec]]:
    """(name, parameter, spec) for every unique sharded parameter of ``module``."""
    return [(n, p, _SPECS[p]) for n, p in module.named_parameters() if is_sharded(p)]
