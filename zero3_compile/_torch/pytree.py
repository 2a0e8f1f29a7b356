"""Tree utilities over nested containers of tensors: ``torch.utils._pytree`` (private module, no
public ``torch.utils.pytree`` through 2.14; torch's own libraries use it), 2.11-2.14."""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

__all__ = ["tree_flatten", "tree_leaves", "tree_map"]
