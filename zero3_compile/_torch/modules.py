"""``torch.nn.Module`` internals: a module's own registries of parameters, buffers and children.

Each returns the registry dict itself (no copy): callers read it in registration order, ``None``
entries included, and some write to it. ``nn.Module`` keeps these private (``_parameters``,
``_buffers``, ``_modules``, ``_non_persistent_buffers_set``); the public readers
(``named_parameters``, ``named_buffers``, ``named_children``) recurse, skip ``None`` and
deduplicate, and the public writers (``setattr``, ``register_parameter``) refuse or reroute what
the writes here must do. Checked 2.13-2.14 (the dicts date from torch 1.0).
"""

from __future__ import annotations

import torch
from torch import nn


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameters by attribute name (``module._parameters``), the dict itself.

    Written where a parameter object is swapped under its name with the registration order,
    hooks and class left alone: ``shard()`` puts each parameter's DTensor shard in its place,
    loading and ``materialize()`` put full-size temporaries in for an initialiser and the shards
    back after it. ``setattr`` cannot: a sharded module's class serves each parameter through a
    property (the gathered value), and ``register_parameter`` refuses a name already taken. Read
    where the sharded parameter itself is wanted, not the gathered value a property returns.
    """
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by attribute name (``module._buffers``), the dict itself: read
    without recursing into children (each module's buffers are saved under its own prefix)."""
    return module._buffers


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """The names of the module's own buffers registered ``persistent=False``
    (``module._non_persistent_buffers_set``): the buffers its ``state_dict()`` leaves out."""
    return module._non_persistent_buffers_set


def own_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's direct submodules by attribute name (``module._modules``), the dict itself:
    read without building ``named_children``'s generator (it deduplicates; the walk here may
    not)."""
    return module._modules


def rnn_flat_weight_names(rnn: nn.RNNBase) -> list[str]:
    """The attribute names of a recurrent module's weights in the order cuDNN's flat buffer takes
    them (``RNNBase._flat_weights_names``): what ``RNNBase._flat_weights`` is rebuilt from."""
    return rnn._flat_weights_names
