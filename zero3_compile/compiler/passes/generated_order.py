"""The post-codegen check: Inductor's generated code issues the collectives as scheduled."""

from __future__ import annotations

import torch.fx as fx

from .. import signature
from ..context import PassContext


def check_generated_order(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Raise ``GeneratedOrderError`` if the generated code (``ctx.generated``) issues the
    collectives in another order than scheduled, keeps more of them in flight, or runs the
    cross-rank guard after one of them (``signature.check_generated_order``).

    All ranks run the same passes, but Inductor sees rank-specific shapes (uneven shards), so a
    reordering there could differ between ranks and hang them.

    **Invariant** checked: the generated code's collectives are the scheduled ones, in the
    scheduled order, after the guard, with no more in flight than scheduled. A no-op without
    generated code (``codegen="eager"``) or collectives.
    """
    generated = ctx.generated
    if generated is None:
        return
    label = f"{ctx.graph_kind} graph {ctx.graph_id}"
    signature.check_generated_order(generated.scheduled, generated.source_code, label)


__all__ = ["check_generated_order"]
