"""The geometry of one sharded parameter, written once: ``ShardSpec``.

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

``torch.chunk`` semantics (the layout of DTensor's ``Shard(0)`` and FSDP2): every rank but the
trailing ones holds ``ceil(dim0 / N)`` rows, the last non-empty one the remainder, the rest none.
Padding only ever sits at the tail of the gathered buffer, so its first ``dim0`` rows are exactly
the full parameter.

[Note: the marker contract]
Reading ``module.weight`` traces to one ``zero3::unshard(shard, param_id, spec, grad_sink)``
node; its backward is ``zero3::reduce_grad(grad, param_id, spec, shard_shape, shard_dtype)``.
``spec`` is ``ShardSpec.literal()``: a canonical, versioned string holding every fact about the
parameter that is the same on every rank. The op schemas never change when a field is added here;
graphs and the generated getters hold the literal, compile caches key on it, and
``ShardSpec.parse`` reads it back (once per distinct literal).

Traced through a module's getter the marker is unbound: ``param_id`` is ``UNBOUND_ID`` and the
literal is ``unbound_literal()`` (no name), so identical blocks trace to identical graphs;
the backend's first step binds every marker to the parameter its shard is read from
(``compiler/passes/bind.py``). Every pass sees bound markers only.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields, replace

import torch

SPEC_VERSION = 1

# the param_id of a marker not yet bound to its parameter (see [Note: the marker contract])
UNBOUND_ID = -1


@dataclass(frozen=True)
class ShardSpec:
    """Everything about one sharded parameter that is the same on every rank.

    fqn: the parameter's canonical name (the first one, for tied parameters).
    shape: the full parameter as the module sees it.
    group, world_size: the process group its rows are split over (the mesh's shard dimension)
        and that group's size.
    replicate_group, replicate_size: hybrid sharding: the group over which the reduced shard's
        gradient is also averaged ("" and 1 otherwise).
    param_dtype, reduce_dtype: mixed precision (None: the shard's / the gradient's dtype).
    offloaded: the shard lives in an offload store between uses (``offload/``).
    grads_offloaded: its reduced gradient goes to the model's gradient spool
        (``offload/grads.py``).
    primary_size: 0, or this spec describes a secondary shard (ZeRO++'s hpZ, see
        [Note: secondary shards] in ``compiler/secondary.py``): the parameter is sharded over
        ``primary_size`` ranks, and ``group`` / ``world_size`` are a node's ranks of that shard
        group, each holding ``primary_size // world_size`` consecutive primary shards (padded).
    """

    fqn: str
    shape: tuple[int, ...]
    group: str
    world_size: int
    replicate_group: str = ""
    replicate_size: int = 1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offloaded: bool = False
    grads_offloaded: bool = False
    primary_size: int = 0

    # ------------------------------------------------------------------ geometry

    @property
    def dim0(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def rows_per_rank(self) -> int:
        if self.primary_size:  # whole primary shards: the gathered buffer is the primary one
            return -(-self.dim0 // self.primary_size) * (self.primary_size // self.world_size)
        return -(-self.dim0 // self.world_size)

    @property
    def padded_numel(self) -> int:
        """Elements each rank contributes to a collective (its shard padded)."""
        return self.rows_per_rank * self.row_numel

    @property
    def full_numel(self) -> int:
        return self.dim0 * self.row_numel

    def gathered_shape(self) -> tuple[int, ...]:
        """Shape of the padded gathered buffer viewed as rows."""
        return (self.rows_per_rank * self.world_size, *self.shape[1:])

    def rows(self, rank: int) -> tuple[int, int]:
        """(first row, number of rows) of ``rank``'s shard; trailing ranks may hold none."""
        start = min(rank * self.rows_per_rank, self.dim0)
        return start, max(0, min(self.dim0, start + self.rows_per_rank) - start)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return (self.rows(rank)[1], *self.shape[1:])

    def local_view(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows of a full-shape tensor, as a view (possibly empty)."""
        self._check_full(full)
        start, count = self.rows(rank)
        return full.narrow(0, start, count)

    def chunk(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows of a full-shape tensor, as a contiguous tensor of its own."""
        return self.local_view(full, rank).clone(memory_format=torch.contiguous_format)

    def _check_full(self, full: torch.Tensor) -> None:
        if tuple(full.shape) != self.shape:
            raise ValueError(
                f"zero3: {self.fqn!r} has shape {self.shape}; got a tensor of shape "
                f"{tuple(full.shape)}"
            )

    def gather_dtype(self, shard_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or shard_dtype

    # ------------------------------------------------------------------ the literal

    def literal(self) -> str:
        """The canonical string of this spec (see [Note: the marker contract])."""
        return _literal(self)

    def unbound_literal(self) -> str:
        """The literal without the name: what the parameters of identical blocks share."""
        return _literal(replace(self, fqn=""))

    @staticmethod
    def parse(literal: str) -> ShardSpec:
        """The spec of a ``literal()``; parsed once per distinct string."""
        return _parse(literal)


@functools.cache
def _literal(spec: ShardSpec) -> str:
    body = {"v": SPEC_VERSION}
    for key, value in asdict(spec).items():
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        elif isinstance(value, tuple):
            value = list(value)
        body[key] = value
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


_FIELDS = {f.name for f in fields(ShardSpec)}


@functools.cache
def _parse(literal: str) -> ShardSpec:
    try:
        body = json.loads(literal)
    except ValueError as error:
        raise ValueError(f"zero3: not a shard spec literal: {literal[:80]!r}") from error
    version = body.pop("v", None)
    if version != SPEC_VERSION:
        raise ValueError(
            f"zero3: a graph holds a shard spec of version {version}, this zero3_compile reads "
            f"version {SPEC_VERSION}: it was compiled by another release; clear the compile "
            "caches (TORCHINDUCTOR_CACHE_DIR) and compile again"
        )
    unknown = set(body) - _FIELDS
    if unknown:
        raise ValueError(f"zero3: shard spec literal with unknown fields {sorted(unknown)}")
    body["shape"] = tuple(body["shape"])
    for key in ("param_dtype", "reduce_dtype"):
        if body.get(key) is not None:
            body[key] = _dtype(body[key])
    return ShardSpec(**body)


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"zero3: shard spec literal names an unknown dtype {name!r}")
    return value


def spec_of_shape(shape, world_size: int, fqn: str = "p", group: str = "0") -> ShardSpec:
    """A spec for arithmetic on shapes alone (estimates, tests)."""
    return ShardSpec(fqn=fqn, shape=tuple(shape), group=group, world_size=world_size)
