"""Everything that differs between the torch releases we support (2.11 through 2.14).

The graph-level functional collectives (``torch.ops._c10d_functional``) are the stable layer:
the Python wrappers around them were renamed in 2.13, the ops were not. Eager code in this
package calls the ops too, so there is a single code path for both modes.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

funcol = torch.ops._c10d_functional

ALL_GATHER = funcol.all_gather_into_tensor.default
REDUCE_SCATTER = funcol.reduce_scatter_tensor.default
WAIT = funcol.wait_tensor.default
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER)

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def is_dtensor_to_local(node) -> bool:
    """Whether an FX node of a dynamo graph is ``DTensor.to_local()``: a ``to_local`` method call,
    or on torch 2.11 a call of a fresh closure dynamo names "prim_to_local"."""
    if node.op == "call_method":
        return node.target == "to_local"
    return node.op == "call_function" and getattr(node.target, "__name__", None) == "prim_to_local"


def all_gather(flat: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """All-gather a flat tensor into (world_size * numel,), waiting for the result."""
    return WAIT(ALL_GATHER(flat, world_size, group_name))


def reduce_scatter_sum(flat: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Sum-reduce-scatter a flat tensor of world_size * n elements into (n,)."""
    return WAIT(REDUCE_SCATTER(flat, "sum", world_size, group_name))


def mesh_from_group(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)


def group_backend(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def default_store() -> dist.Store | None:
    """The store the default process group was created with (None if unavailable)."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, ValueError):
        return None


def store_wait(store: dist.Store, keys: list[str], timeout_s: float) -> None:
    store.wait(keys, timedelta(seconds=timeout_s))
