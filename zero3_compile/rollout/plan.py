"""What a weight export hands out, in order: ``plan(model, lora) -> list[Entry]``.

Without adapters: every key of ``model.state_dict()`` in its order (tied parameters under each
of their names, persistent buffers), read from the modules without loading offloaded shards.
With peft adapters (``adapters.py``) the entries are renamed, merged or filtered first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.modules import non_persistent_buffer_names, own_buffers, own_parameters
from ..sharding.state import ShardedParam, state_of

LORA_MODES = ("merged", "adapter", "base")


@dataclass
class Entry:
    """One exported tensor.

    name: the name it is exported under.
    state: a sharded parameter, gathered for it (plain ``all-gather`` of its shard).
    tensor: anything else: a buffer, an unsharded parameter, a ``DTensor`` of another layout
        (``full_tensor()``), a tensor-parallel sharded parameter (likewise).
    merge: LoRA deltas added to the gathered tensor (``adapters.LoraMerge``).
    """

    name: str
    state: ShardedParam | None = None
    tensor: torch.Tensor | None = None
    merge: Any = None


def state_entries(model: nn.Module) -> list[tuple[str, Any]]:
    """(key, ShardedParam or tensor) of every ``model.state_dict()`` key, in its order, reading
    nothing (``state_dict()`` itself would load every offloaded shard)."""
    found = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in own_parameters(module).items():
            if param is not None:
                found.append((dot + name, state_of(param) or param))
        for name, buffer in own_buffers(module).items():
            if buffer is not None and name not in non_persistent_buffer_names(module):
                found.append((dot + name, buffer))
    return found


def entry(name: str, value: Any) -> Entry:
    """The entry exporting ``value`` (from ``state_entries``) under ``name``."""
    if isinstance(value, ShardedParam):
        if value.layout is not None:  # tensor parallel: DTensor's gather over both dimensions
            return Entry(name, tensor=value.param)
        return Entry(name, state=value)
    return Entry(name, tensor=value)


def plan(model: nn.Module, lora: str) -> list[Entry]:
    """The entries of an export of ``model`` (``lora``: see ``iter_full_parameters``)."""
    from .adapters import peft_plan

    if lora not in LORA_MODES:
        raise ValueError(f"zero3: lora={lora!r}; pass one of {LORA_MODES}")
    values = state_entries(model)
    planned = peft_plan(model, values, lora)
    if planned is not None:
        return planned
    if lora == "adapter":
        raise ValueError(
            "zero3: lora='adapter' exports a peft model's adapter weights; this model has no "
            "peft adapters (pass lora='merged' to export its weights)"
        )
    return [entry(name, value) for name, value in values]


def full_of_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that is not one of zero3's shards, whole (collective for a ``DTensor``)."""
    if isinstance(tensor, DTensor):
        return tensor.detach().full_tensor()
    return tensor.detach()
