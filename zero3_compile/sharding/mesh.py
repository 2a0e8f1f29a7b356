"""The ranks a model is sharded over and the role of each mesh dimension: ``DataParallelMesh``
(FSDP2's ``DPMeshInfo`` plays this role).

- flat: a process group (default: the world) or a 1-D mesh; parameters are split over it;
- hybrid: a 2-D mesh with dimensions named ``("replicate", "shard")`` (or ``dp_replicate`` /
  ``dp_shard``): split within a row, replicated across rows.

The mesh may be a sub-mesh of the job (one data-parallel group per pipeline stage or per
tensor-parallel column): nothing here needs a rank outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .policy import MixedPrecision
from .spec import ShardSpec

_SHARD_NAMES = ("shard", "dp_shard")
_REPLICATE_NAMES = ("replicate", "dp_replicate")


@dataclass(frozen=True, eq=False)
class DataParallelMesh:
    """The data-parallel mesh of one ``shard()`` call, on this rank."""

    mesh: DeviceMesh  # of the parameters' DTensors
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    placements: tuple  # the parameters' DTensor placements, one per mesh dimension

    @classmethod
    def resolve(
        cls, group: dist.ProcessGroup | None, mesh: DeviceMesh | None, device_type: str
    ) -> DataParallelMesh:
        """From ``shard(group=...)`` or ``shard(mesh=...)``; clear errors for anything else."""
        if mesh is None:
            group = group if group is not None else dist.group.WORLD
            return cls(DeviceMesh.from_group(group, device_type), group, None, (Shard(0),))
        if group is not None:
            raise ValueError("zero3: pass either group= or mesh= to shard(), not both")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"zero3: mesh= must be a DeviceMesh, got {type(mesh).__name__}")
        if mesh.get_coordinate() is None:
            raise ValueError(
                f"zero3: rank {dist.get_rank()} is not in the mesh given to shard() (ranks "
                f"{mesh.mesh.flatten().tolist()}); pass each rank the mesh it belongs to "
                "(mesh['dp'] of the job's mesh)"
            )
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(), None, (Shard(0),))
        names = tuple(mesh.mesh_dim_names or ())
        roles = [_role(name) for name in names]
        if mesh.ndim != 2 or sorted(r or "" for r in roles) != ["replicate", "shard"]:
            raise ValueError(
                f"zero3: shard(mesh=...) takes a 1-D mesh or a 2-D mesh whose dimensions are "
                f"named ('replicate', 'shard'); got {mesh.ndim} dimension(s) named {names}. Build "
                "it with init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names="
                "('replicate', 'shard')), or pass the data-parallel part of a larger mesh "
                "(mesh['dp'], or mesh['replicate', 'shard'])"
            )
        shard_name = names[roles.index("shard")]
        replicate_name = names[roles.index("replicate")]
        placements = tuple(Shard(0) if r == "shard" else Replicate() for r in roles)
        return cls(mesh, mesh[shard_name].get_group(), mesh[replicate_name].get_group(), placements)

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def shard_rank(self) -> int:
        """This rank's index in the shard group: which rows it holds."""
        return dist.get_rank(self.shard_group)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def group_names(self) -> tuple[str, str]:
        """(shard group name, replicate group name or "")."""
        replicate = "" if self.replicate_group is None else self.replicate_group.group_name
        return self.shard_group.group_name, replicate

    @property
    def ranks(self) -> list[int]:
        """Every global rank of the mesh, sorted: whose collectives depend on each other."""
        return sorted(int(r) for r in self.mesh.mesh.flatten().tolist())

    def spec(
        self,
        fqn: str,
        shape,
        policy: MixedPrecision | None = None,
        offloaded: bool = False,
        grads_offloaded: bool = False,
    ) -> ShardSpec:
        """The ``ShardSpec`` of a parameter of full ``shape`` sharded over this mesh, gathered
        and reduced in ``policy``'s dtypes (``None``: the parameter's own)."""
        shard_name, replicate_name = self.group_names
        policy = policy if policy is not None else MixedPrecision()
        return ShardSpec(
            fqn=fqn,
            shape=tuple(shape),
            group=shard_name,
            world_size=self.shard_size,
            replicate_group=replicate_name,
            replicate_size=self.replicate_size,
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            offloaded=offloaded,
            grads_offloaded=grads_offloaded,
        )

    def wrap(self, local: torch.Tensor, spec: ShardSpec, layout=None) -> DTensor:
        """This rank's shard as the parameter's ``DTensor`` (global shape and stride); for a
        tensor-parallel parameter (``layout``, see [Note: zero3 over tensor parallelism]) on the
        concatenated (dp, tp) mesh."""
        if layout is None:
            mesh, placements, shape = self.mesh, self.placements, spec.shape
        else:
            (mesh, placements), shape = layout.combined(self.mesh, self.placements), layout.shape
        return DTensor.from_local(
            local,
            mesh,
            list(placements),
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )


def _role(name: str | None) -> str | None:
    if name in _SHARD_NAMES:
        return "shard"
    if name in _REPLICATE_NAMES:
        return "replicate"
    return None


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def group_backend(group: dist.ProcessGroup) -> str:
    """The backend of a process group, lower case ("gloo", "nccl", "fake"...)."""
    return str(dist.get_backend(group)).lower()
