"""Parameters that are already ``DTensor``s of a model-parallel mesh: ``TensorParallelLayout``.

[Note: zero3 over tensor parallelism]
``parallelize_module`` (torch's TP) replaces a parameter by a ``DTensor`` on the TP mesh:
``Shard(0)`` (colwise), ``Shard(1)`` (rowwise), ``Replicate()`` (norms, sequence parallel).
zero3 then shards the *TP-local* tensor along dim 0 over the data-parallel mesh, as FSDP2 does:

- the ``ShardSpec`` describes the TP-local tensor (what zero3 gathers and reduces); the passes
  never see TP;
- the parameter is one ``DTensor`` on the concatenated (dp..., tp) mesh with the TP-global shape;
  its placements are the data-parallel ones followed by TP's, where the dp ``Shard(0)`` becomes
  ``_StridedShard(0, split_factor=<TP's shards of dim 0>)`` when TP shards dim 0 too (the dp
  chunk is a chunk *of each TP chunk*), so ``full_tensor()``, ``clip_grad_norm_``, optimizers and
  DCP see true global shapes and offsets;
- the getter hands the module the gathered TP-local tensor re-wrapped as the TP ``DTensor`` the
  module expects (``wrap``); TP's own collectives (the rowwise all-reduce, sequence-parallel
  gathers, the ``Partial`` -> ``Replicate`` gradient all-reduce of a replicated weight) stay where
  DTensor puts them: they are foreign collectives to zero3's passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._torch.dtensor import concatenate_meshes, local_tensor, strided_shard
from .mesh import contiguous_stride


@dataclass(frozen=True, eq=False)
class TensorParallelLayout:
    """How a ``DTensor`` parameter handed to ``shard()`` is laid out on its own (TP) mesh."""

    mesh: DeviceMesh
    placements: tuple
    shape: tuple[int, ...]  # the TP-global shape
    stride: tuple[int, ...]
    # False: a plain parameter of a model with TP parameters: stored replicated over the TP mesh
    # (one mesh for every parameter, as clip_grad_norm_ and optimizers need) and handed to the
    # module as the plain tensor it was
    module_sees_dtensor: bool = True

    @classmethod
    def replicated(cls, mesh: DeviceMesh, shape) -> TensorParallelLayout:
        """The layout of a plain parameter beside TP parameters on ``mesh``."""
        shape = tuple(shape)
        return cls(mesh, (Replicate(),) * mesh.ndim, shape, contiguous_stride(shape), False)

    @classmethod
    def of(cls, name: str, param: DTensor, dp_ranks: list[int]) -> TensorParallelLayout:
        """The layout of ``param``; clear errors for what zero3 cannot shard further."""
        mesh = param.device_mesh
        for placement in param.placements:
            if not isinstance(placement, (Shard, Replicate)) or _is_strided(placement):
                raise ValueError(
                    f"zero3: parameter {name!r} is a DTensor with placements {param.placements}; "
                    "zero3 shards DTensor parameters of tensor parallelism (Shard or Replicate "
                    "placements, as parallelize_module makes them). Parameters already sharded "
                    "by FSDP2 or another zero3 cannot be sharded again"
                )
        overlap = set(dp_ranks) & set(mesh.mesh.flatten().tolist())
        if mesh.ndim != 1 or overlap != {dist.get_rank()}:
            raise ValueError(
                f"zero3: parameter {name!r} is a DTensor on a mesh of ranks "
                f"{mesh.mesh.flatten().tolist()} (dimensions {mesh.mesh_dim_names}) that is not "
                f"a 1-D model-parallel mesh orthogonal to the data-parallel ranks {dp_ranks}; "
                "apply parallelize_module with mesh['tp'] and pass shard(mesh=mesh['dp']) of the "
                "same init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
            )
        if not local_tensor(param).is_contiguous():
            raise ValueError(
                f"zero3: parameter {name!r} has a non-contiguous local tensor; make it "
                "contiguous before zero3_compile.shard"
            )
        return cls(mesh, tuple(param.placements), tuple(param.shape), tuple(param.stride()))

    @property
    def dim0_shards(self) -> int:
        """Into how many pieces TP splits dim 0 (1: it does not)."""
        count = 1
        for size, placement in zip(self.mesh.shape, self.placements):
            if isinstance(placement, Shard) and placement.dim == 0:
                count *= size
        return count

    def key(self) -> tuple:
        """What the parameters of identical blocks share (the generated classes' key)."""
        return (id(self.mesh), self.placements, self.shape, self.stride, self.module_sees_dtensor)

    def wrap(self, local: torch.Tensor) -> DTensor:
        """The gathered TP-local tensor as the TP ``DTensor`` the module expects."""
        if not self.module_sees_dtensor:
            return local
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.shape,
            stride=self.stride,
        )

    def combined(self, dp_mesh: DeviceMesh, dp_placements: tuple) -> tuple[DeviceMesh, tuple]:
        """(mesh, placements) of the zero3 parameter: the dp dimensions, then TP's."""
        mesh = concatenate_meshes([dp_mesh, self.mesh])
        split = self.dim0_shards
        placements = tuple(
            strided_shard(0, split) if isinstance(p, Shard) and split > 1 else p
            for p in dp_placements
        )
        return mesh, placements + self.placements


def _is_strided(placement) -> bool:
    return type(placement).__name__ == "_StridedShard"


def model_parallel_mesh(named) -> DeviceMesh | None:
    """The one TP mesh of a model's DTensor parameters (None: no DTensor parameter)."""
    meshes = {}
    for name, param in named:
        if isinstance(param, DTensor):
            meshes.setdefault(param.device_mesh, name)
    if len(meshes) > 1:
        found = {name: str(mesh) for mesh, name in meshes.items()}
        raise ValueError(
            f"zero3: the model's DTensor parameters are on different meshes {found}; zero3 "
            "shards a model whose tensor-parallel parameters share one mesh (parallelize_module "
            "with the same mesh['tp'] for every submodule)"
        )
    return next(iter(meshes), None)


# the ranks of a group -> "mesh:<dimension name>", for the model-parallel meshes of sharded
# models: a foreign collective's group in the cross-rank check (rank 0's tp group is not rank
# 2's, but both are "tp"). Keyed by ranks, not names: DTensor may issue a collective over another
# group of the same ranks (a mesh rebuilt from a compiled graph's constants)
_MESH_DIM_OF_RANKS: dict[tuple[int, ...], str] = {}


def register_mesh_dims(mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    for dim, name in enumerate(names):
        ranks = dist.get_process_group_ranks(mesh.get_group(dim))
        _MESH_DIM_OF_RANKS[tuple(sorted(ranks))] = f"mesh:{name}"


def foreign_group_role(group_name: str) -> str:
    """What a collective we did not insert is issued over, the same on every rank where it can be
    told: its mesh dimension's name; else the group's name."""
    from .._torch.c10d import resolve_group

    try:
        ranks = tuple(sorted(dist.get_process_group_ranks(resolve_group(group_name))))
    except (RuntimeError, ValueError, KeyError, AttributeError):  # a graph read offline
        return group_name
    return _MESH_DIM_OF_RANKS.get(ranks, group_name)


def wrap_full(state, full: torch.Tensor) -> torch.Tensor:
    """``full`` as the module sees the parameter: the TP ``DTensor`` for a TP parameter."""
    layout = state.layout
    return full if layout is None else layout.wrap(full)
