"""What one ``shard()`` call owns: ``Zero3Runtime``.

The mesh, the mixed-precision policy, the device, the cross-rank check with its own timeout, the
leaf modules, the offload configuration, the optimizers it hooks and the pending state of a
``load_state_dict`` into offloaded shards: all of it lives on the model's runtime, reached from
every module and parameter of the model (``ModuleState.root``, ``ShardedParam.root``), never in
process-wide tables. Two models sharded in one process, with other meshes, policies or timeouts,
do not see each other.

Eager collectives learn whose they are from the runtime made active around them (the generated
getters and the eager paths enter ``runtime.active()``): the timeout of the check is that model's.
A parameter read by a graph another backend compiled runs the eager operation with no runtime
active; it is checked on its mesh's side channel with the default timeout.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ..sharding.mesh import DataParallelMesh
from ..sharding.policy import MixedPrecision
from ..sharding.spec import ShardSpec
from .guard import DEFAULT_TIMEOUT_S, Guard, channel_of, open_channel, run_check

_local = threading.local()


class Zero3Runtime:
    """The runtime of one sharded model (see the module docstring)."""

    def __init__(
        self,
        dp: DataParallelMesh,
        policy: MixedPrecision,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        offload: Any = None,
    ):
        self.dp = dp
        self.policy = policy
        self.device = device
        self.offload = offload  # offload.model.Offload, when parameter shards are offloaded
        self.offload_store = None  # its store (offload/store.py), opened by shard()
        self.grad_spool = None  # offload.grads.GradSpool, when gradient shards are offloaded
        self.leaves: list[weakref.ref] = []  # leaf modules (set_leaf_modules)
        self.pending_loads: list = []  # offloaded shards loaded by a running load_state_dict
        # shard(sync_module_states=): materialize() broadcasts the first rank's values too
        self.sync_module_states = True
        self.timeout_s = float(timeout_s)
        # graphs a zero3 backend compiled reading this model's parameters (explain compiles
        # through the model's own backend only while it is 0: see tools/inspect/explain.py)
        self.graphs_compiled = 0
        channel = open_channel(dp.group_names, dp.ranks, dp.shard_group, self.timeout_s)
        self.guard = Guard(channel, self.timeout_s) if channel is not None else None
        self._enter = _Active(self)

    # ------------------------------------------------------------------ facts

    @property
    def world_size(self) -> int:
        return self.dp.shard_size

    @property
    def rank(self) -> int:
        return self.dp.shard_rank

    @property
    def mesh(self):
        return self.dp.mesh

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        if self.guard is not None:
            self.guard.timeout_s = self.timeout_s

    def active(self) -> _Active:
        """``with runtime.active():`` eager collectives in the block are this model's."""
        return self._enter

    # ------------------------------------------------------------------ optimizer steps

    def before_step(self, optimizer, args, kwargs) -> None:
        """Runs before ``step()`` of every optimizer holding this model's parameters."""
        from .optimizers import before_step

        before_step(self, optimizer)

    def after_step(self, optimizer, args, kwargs) -> None:
        from .optimizers import after_step

        after_step(self, optimizer)

    def __reduce__(self):
        # unpickled in a process with the same process group (or the default one)
        if self.dp.replicate_group is not None:
            raise NotImplementedError(
                "zero3: pickling a model sharded on a 2-D mesh is not supported; save it with "
                "zero3_compile.save_checkpoint"
            )
        return (_rebuild, (self.dp.shard_group.group_name, self.policy, self.device.type,
                           self.timeout_s))  # fmt: skip


def _rebuild(
    group_name: str, policy: MixedPrecision, device_type: str, timeout_s: float
) -> Zero3Runtime:
    import torch.distributed as dist

    from .._torch.c10d import resolve_group

    try:
        group = resolve_group(group_name)
    except Exception:  # noqa: BLE001  - not known here: the default group
        group = dist.group.WORLD
    dp = DataParallelMesh.resolve(group, None, device_type)
    return Zero3Runtime(dp, policy, torch.device(device_type), timeout_s)


class _Active:
    """The context manager of ``Zero3Runtime.active()`` (a plain class: it runs at every eager
    parameter read)."""

    __slots__ = ("runtime",)

    def __init__(self, runtime: Zero3Runtime):
        self.runtime = runtime

    def __enter__(self) -> Zero3Runtime:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self.runtime)
        return self.runtime

    def __exit__(self, *exc) -> None:
        _local.stack.pop()


def active_runtime() -> Zero3Runtime | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def check_eager(
    spec: ShardSpec, kind: int, code: int, label: str, presence: list[bool] | None = None
) -> list[bool] | None:
    """The cross-rank check before an eager collective of ``spec``'s parameter."""
    runtime = active_runtime()
    if runtime is not None and runtime.dp.group_names == (spec.group, spec.replicate_group):
        if runtime.guard is None:
            return presence
        return runtime.guard.check(kind, code, label, presence)
    return run_check(channel_of(spec.group, spec.replicate_group), kind, code, label, presence)
