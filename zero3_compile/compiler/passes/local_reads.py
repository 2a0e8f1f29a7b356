"""torch 2.11's shard reads, rewritten in the dynamo graph before AOTAutograd traces it."""

from __future__ import annotations

import torch.fx as fx

from ..._torch import dynamo
from ..context import PassContext, source_hash


def rewrite_to_local(gm: fx.GraphModule, ctx: PassContext) -> None:
    """On torch 2.11, read shards through ``_torch.dtensor.local_shard`` instead of
    ``DTensor.to_local()`` (``_torch.dynamo.rewrite_to_local``): 2.11's ``to_local`` backward
    turns a missing gradient into zeros, so a shard no gradient reaches (sync off, an expert no
    token reached) would get a zero gradient instead of none.

    **Invariant** after: on torch 2.11, no ``to_local()`` call without arguments is left in the
    graph or its subgraphs; each replacement carries the package's source hash, which keeps
    AOTAutograd's cache open to it. A no-op on torch 2.12 and later.
    """
    dynamo.rewrite_to_local(gm, source_hash())


__all__ = ["rewrite_to_local"]
