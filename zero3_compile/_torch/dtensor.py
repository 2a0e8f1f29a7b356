"""DTensor internals: private placements, mesh concatenation, the shard read's backward, the held
local tensor and the spec."""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh

from . import VERSION


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh of the dimensions of ``meshes`` (slices of one ``init_device_mesh``), as FSDP2
    builds its data-parallel x tensor-parallel mesh. ``DeviceMesh._concatenate`` is private (no
    public alternative); checked 2.13-2.14, present since 2.8."""
    try:
        return DeviceMesh._concatenate(meshes)
    except (RuntimeError, AttributeError, TypeError, AssertionError) as error:
        raise ValueError(
            "zero3: the data-parallel mesh and the tensor-parallel mesh of a DTensor parameter "
            f"must be named dimensions of one init_device_mesh ({error}); build "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), apply "
            "parallelize_module(model, mesh['tp'], plan) and call shard(model, mesh=mesh['dp'])"
        ) from error


def strided_shard(dim: int, split_factor: int):
    """``_StridedShard(dim, split_factor)``: a dim-0 chunk of each of ``split_factor`` chunks (the
    dp placement of a parameter TP shards along the same dimension, as FSDP2 stores it). Private
    placement, no public alternative; 2.11-2.14."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def to_local_keeps_missing_gradients() -> bool:
    """Whether ``DTensor.to_local()``'s backward leaves a missing gradient missing. torch 2.12
    to 2.14 do; 2.11 turns it into zeros (its ``_ToTorchTensor`` materializes gradients), so a
    parameter whose shard gets no gradient (sync off: the full gradient goes to the sink; an
    expert no token reached) would receive a zero gradient instead of none (an optimizer steps
    it, AccumulateGrad adds it to a pending gradient)."""
    return VERSION >= (2, 12)


@functools.cache
def _local_shard_function():
    """torch 2.11's ``_ToTorchTensor`` (private ``torch.distributed.tensor._api``) with
    2.13's handling of a missing gradient: none in, none out."""
    from torch.distributed.tensor._api import _ToTorchTensor

    class LocalShard(_ToTorchTensor):
        @staticmethod
        def forward(ctx, dtensor):
            ctx.set_materialize_grads(False)
            return _ToTorchTensor.forward(ctx, dtensor, None)

        @staticmethod
        def backward(ctx, grad):
            return None if grad is None else _ToTorchTensor.backward(ctx, grad)[0]

    return LocalShard


def local_shard(dtensor) -> torch.Tensor:
    """``dtensor.to_local()`` (no ``grad_placements``) whose backward gives no gradient where
    none came, on every supported torch (``to_local_keeps_missing_gradients``). In a graph
    dynamo traces, the method call itself (``dynamo.rewrite_to_local`` swaps it before
    AOTAutograd)."""
    if torch.compiler.is_compiling():
        return dtensor.to_local()
    if to_local_keeps_missing_gradients():
        # DTensor's own: an offloaded shard's to_local() hands users its store's values
        # (offload/access.py); here it is the shard's tensor itself
        from torch.distributed.tensor import DTensor

        return DTensor.to_local(dtensor)
    return _local_shard_function().apply(dtensor)


def local_tensor(dtensor) -> torch.Tensor:
    """The tensor a DTensor holds, the object itself (private ``DTensor._local_tensor``).

    ``to_local()`` is the public read, but it records a backward and dispatches through
    ``__torch_function__`` (an offloaded shard's hands out its store's values): read here where
    the code runs below autograd (gradient hooks, ``__torch_dispatch__``, optimizer state) or
    needs the held object's own type (a ``GatheredParameter``, a ``StoredTensor``). No public
    alternative; checked 2.13-2.14.
    """
    return dtensor._local_tensor


def spec_of(dtensor):
    """A DTensor's ``DTensorSpec`` (private ``DTensor._spec``: mesh, placements, global shape and
    stride), for ``DTensor(local, spec_of(like), requires_grad=...)``: a DTensor of the same
    layout around another local tensor with no check, copy, collective or autograd edge (what
    ``from_local`` builds after its checks). No public alternative; checked 2.13-2.14."""
    return dtensor._spec
