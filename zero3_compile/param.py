"""The state of a sharded parameter and of a module owning some, and the marker contract.

[Note: zero3 tensors]
The words the code uses for the tensors of one parameter (N ranks, ``torch.chunk`` layout):

- shard: this rank's dim-0 chunk, the ``_local_tensor`` of the ``DTensor`` parameter
  (``Shard(0)``). The trailing ranks' shards may be shorter or empty.
- padded: a shard padded at the end to ``rows_per_rank`` rows, so every rank sends as many
  elements to a collective.
- gathered: the output of an all-gather, N padded shards one after the other (rank-major).
- full: the parameter as the model sees it, the first ``dim0`` rows of the gathered buffer.
- copy-in: building a collective's flat input (cast, flatten, pad, concatenate a bucket).
- copy-out: taking the collective's output apart: full parameters out of a gathered bucket, or
  this rank's gradient shard out of a reduced bucket (then the division by N and the cast back).
- bucket: the parameters (or gradients) that share one collective.
- sink: a zero-strided full-shape leaf that receives a parameter's full, unreduced gradient while
  gradient synchronisation is off (``set_requires_gradient_sync``).

The marker contract: reading ``module.weight`` traces to one ``zero3::unshard`` node whose
arguments are the shard, the fields of ``MarkerArgs`` in ``MARKER_FIELDS`` order, and an optional
sink. The op schemas (``ops.py``), the generated getters (``shard.py``) and the call decoders
(``UnshardCall`` / ``ReduceGradCall``) are all built from ``MARKER_FIELDS``.
"""

from __future__ import annotations

import zlib
from dataclasses import astuple, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .layout import ShardLayout

if TYPE_CHECKING:
    import torch.fx as fx
    import torch.nn as nn

    from .mixed_precision import MixedPrecision


@dataclass(frozen=True)
class MarkerArgs:
    """What a marker node knows about its parameter; the same on every rank."""

    # stable: a code of the canonical name and full shape, equal on every rank and in every
    # instance of the same model (so compiled code is shared); the shard input tells instances
    # apart where it matters (dedupe)
    param_id: int
    full_shape: tuple[int, ...]
    group_name: str
    world_size: int
    param_dtype: torch.dtype | None  # mixed precision: gather and compute in this dtype
    reduce_dtype: torch.dtype | None  # mixed precision: reduce gradients in this dtype
    fqn: str  # the parameter's canonical name (the first, for tied parameters)
    offloaded: bool = False  # the shard lives in an offload store between uses (offload/)
    # hybrid sharding (2-D mesh): gradients are also averaged over this replicate group
    replicate_group: str = ""
    replicate_size: int = 1

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(tuple(self.full_shape), self.world_size)

    def literal(self) -> str:
        """The fields as Python literals, in schema order (for generated source code)."""
        return ", ".join(_literal(getattr(self, f.name)) for f in fields(self))

    @classmethod
    def decode(cls, values) -> MarkerArgs:
        values = list(values)
        values[1] = tuple(values[1])  # full_shape: a list in graphs
        return cls(*values)


# (field name, schema type) in the order every op signature and generated getter uses
_SCHEMA_TYPES = {
    "param_id": "int",
    "full_shape": "SymInt[]",
    "group_name": "str",
    "world_size": "int",
    "param_dtype": "ScalarType?",
    "reduce_dtype": "ScalarType?",
    "fqn": "str",
    "offloaded": "bool",
    "replicate_group": "str",
    "replicate_size": "int",
}
MARKER_FIELDS: tuple[tuple[str, str], ...] = tuple(
    (f.name, _SCHEMA_TYPES[f.name]) for f in fields(MarkerArgs)
)
NUM_MARKER_FIELDS = len(MARKER_FIELDS)


def marker_schema(head: str, tail: str, returns: str) -> str:
    """An op schema: ``head`` arguments, the marker fields, ``tail`` arguments."""
    middle = ", ".join(f"{kind} {name}" for name, kind in MARKER_FIELDS)
    args = ", ".join(part for part in (head, middle, tail) if part)
    return f"({args}) -> {returns}"


def _literal(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value)  # "torch.bfloat16"
    if isinstance(value, tuple):
        return repr(list(value))
    return repr(value)


class UnshardCall(NamedTuple):
    """A ``zero3::unshard`` node's arguments by name."""

    shard: Any
    args: MarkerArgs
    grad_sink: Any

    @classmethod
    def of(cls, node: fx.Node) -> UnshardCall:
        values = list(node.args)
        sink = values[1 + NUM_MARKER_FIELDS] if len(values) > 1 + NUM_MARKER_FIELDS else None
        sink = node.kwargs.get("grad_sink", sink)
        return cls(values[0], MarkerArgs.decode(values[1 : 1 + NUM_MARKER_FIELDS]), sink)


class ReduceGradCall(NamedTuple):
    """A ``zero3::reduce_grad`` node's arguments by name."""

    grad: Any
    args: MarkerArgs
    shard_shape: list[int]
    shard_dtype: torch.dtype

    @classmethod
    def of(cls, node: fx.Node) -> ReduceGradCall:
        values = list(node.args) + [
            node.kwargs[k] for k in ("shard_shape", "shard_dtype") if k in node.kwargs
        ]
        tail = values[1 + NUM_MARKER_FIELDS :]
        return cls(values[0], MarkerArgs.decode(values[1 : 1 + NUM_MARKER_FIELDS]), *tail)


# --------------------------------------------------------------------------- per-parameter state

_STATE_ATTR = "_zero3_state"


@dataclass(eq=False)
class ShardedParam:
    """Everything zero3 keeps about one sharded parameter (FSDP2's ``FSDPParam`` plays this role).

    Reached through ``state_of(param)``. The parameter itself stays an ordinary ``nn.Parameter``
    holding a ``DTensor``; this record is attached to it and re-attached when ``model.to()`` or
    ``model.half()`` swap the parameter's contents.
    """

    param_id: int
    fqn: str
    full_shape: tuple[int, ...]
    group_name: str
    world_size: int
    rank: int  # this rank's index in the group
    policy: MixedPrecision
    param: nn.Parameter = field(repr=False)
    # gradient accumulation without synchronisation (accumulation.py)
    requires_sync: bool = True
    offload: Any = field(default=None, repr=False)  # offload.params.OffloadedShard
    replicate_group: str = ""  # hybrid sharding: the replicate group's name
    replicate_size: int = 1
    grad_sink: torch.Tensor | None = field(default=None, repr=False)
    # set_requires_gradient_sync(..., keep_gathered=True): the full parameter, kept gathered while
    # gradient sync is off; its .grad accumulates the micro-batches' full gradients
    kept_full: torch.Tensor | None = field(default=None, repr=False)

    @property
    def marker(self) -> MarkerArgs:
        return MarkerArgs(
            self.param_id,
            self.full_shape,
            self.group_name,
            self.world_size,
            self.policy.param_dtype,
            self.policy.reduce_dtype,
            self.fqn,
            self.offload is not None,
            self.replicate_group,
            self.replicate_size,
        )

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(self.full_shape, self.world_size)

    def local(self) -> torch.Tensor:
        """This rank's shard (a plain tensor sharing the parameter's storage)."""
        return self.param.to_local()

    def attach(self, param: nn.Parameter) -> None:
        self.param = param
        param.__dict__[_STATE_ATTR] = self

    def __reduce__(self):
        # pickling a sharded model rebuilds fresh states (shard.py); never carry ids across
        return (_detached_state, ())


def _detached_state() -> None:
    return None


def param_id_of(fqn: str, full_shape) -> int:
    """The stable id of a parameter: 31 bits of its name and shape (see ``MarkerArgs``)."""
    return zlib.crc32(f"{fqn}:{list(full_shape)}".encode()) & 0x7FFFFFFF


def state_of(param: Any) -> ShardedParam | None:
    """The ``ShardedParam`` of a sharded parameter, None for anything else."""
    if not isinstance(param, torch.Tensor):
        return None
    state = getattr(param, "__dict__", {}).get(_STATE_ATTR)
    return state if isinstance(state, ShardedParam) and state.param is param else None


def is_sharded(param: Any) -> bool:
    return state_of(param) is not None


# --------------------------------------------------------------------------- per-module state

_MODULE_ATTR = "_zero3"


@dataclass(eq=False)
class ModuleState:
    """What zero3 keeps about one module of a sharded model (in its ``__dict__``).

    params: the module's own sharded parameters by attribute name.
    requires_sync: False while gradient synchronisation is off (``set_requires_gradient_sync``).
    scope: full parameters gathered for the running forward of an enclosing leaf module
        (``set_leaf_modules``), by attribute name; None outside of one.
    root: the state of the module ``shard()`` was called on (group, mesh, policy), shared.
    """

    params: dict[str, ShardedParam] = field(default_factory=dict)
    requires_sync: bool = True
    scope: dict[str, torch.Tensor] | None = None
    root: ShardRoot | None = None
    prefix: str = ""  # this module's qualified name under the root

    def sink(self, attr: str) -> torch.Tensor | None:
        return self.params[attr].grad_sink

    def kept(self, attr: str) -> torch.Tensor | None:
        return self.params[attr].kept_full

    def __reduce__(self):
        return (_detached_state, ())


@dataclass(eq=False)
class ShardRoot:
    """Facts shared by every module of one ``shard()`` call."""

    group: Any  # the ProcessGroup parameters are sharded over
    mesh: Any  # the DeviceMesh of the parameters' DTensors (1-D, or 2-D for hybrid sharding)
    policy: MixedPrecision
    world_size: int  # ranks in ``group``
    rank: int  # this rank's index in ``group``
    device: torch.device
    leaves: list = field(default_factory=list)  # weak references to leaf modules
    offload: Any = None  # offload.params.Offload, when parameter shards are offloaded
    replicate_group: Any = None  # hybrid sharding: the ProcessGroup gradients are averaged over
    placements: tuple = ()  # the parameters' DTensor placements

    @property
    def replicate_size(self) -> int:
        import torch.distributed as dist

        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    def __reduce__(self):
        # unpickled in a process with the same process group (or the default one)
        if self.replicate_group is not None:
            raise NotImplementedError(
                "zero3: pickling a model sharded on a 2-D mesh is not supported; save it with "
                "zero3_compile.save_checkpoint"
            )
        return (_rebuild_root, (self.group.group_name, self.policy, self.device.type))


def _rebuild_root(group_name: str, policy: MixedPrecision, device_type: str) -> ShardRoot:
    import torch.distributed as dist

    from .compat import mesh_from_group, resolve_group

    try:
        group = resolve_group(group_name)
    except Exception:  # noqa: BLE001  - not known here: the default group
        group = dist.group.WORLD
    from torch.distributed.tensor import Shard

    return ShardRoot(
        group,
        mesh_from_group(group, device_type),
        policy,
        dist.get_world_size(group),
        dist.get_rank(group),
        torch.device(device_type),
        placements=(Shard(0),),
    )


def module_state(module: Any) -> ModuleState | None:
    state = getattr(module, "__dict__", {}).get(_MODULE_ATTR)
    return state if isinstance(state, ModuleState) else None


def set_module_state(module: Any, state: ModuleState) -> None:
    module.__dict__[_MODULE_ATTR] = state


def marker_tuple(args: MarkerArgs) -> tuple:
    return astuple(args)
