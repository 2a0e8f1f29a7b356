"""Shard layout arithmetic: how a full parameter splits into world_size dim-0 chunks.

``torch.chunk`` semantics (the layout DTensor's ``Shard(0)`` and FSDP2 use): every rank but the
trailing ones holds ``ceil(dim0 / world)`` rows, the last non-empty one the remainder, the rest
nothing. Collectives need equal sizes, so each rank's shard is padded at the end to
``rows_per_rank`` rows. Since padding only ever sits at the tail of the gathered buffer, the
first ``dim0`` rows of the gathered buffer are exactly the full parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    full_shape: tuple[int, ...]
    world_size: int

    @property
    def dim0(self) -> int:
        return self.full_shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.full_shape[1:])

    @property
    def rows_per_rank(self) -> int:
        return -(-self.dim0 // self.world_size)

    @property
    def padded_numel(self) -> int:
        """Elements each rank contributes to a collective (its shard padded)."""
        return self.rows_per_rank * self.row_numel

    @property
    def full_numel(self) -> int:
        return self.dim0 * self.row_numel

    def local_rows(self, rank: int) -> int:
        start = rank * self.rows_per_rank
        return max(0, min(self.dim0, start + self.rows_per_rank) - start)

    def gathered_shape(self) -> tuple[int, ...]:
        """Shape of the padded gathered buffer viewed as rows."""
        return (self.rows_per_rank * self.world_size, *self.full_shape[1:])
