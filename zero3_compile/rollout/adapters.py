"""peft models in a weight export: ``lora="merged"``, ``"base"`` or ``"adapter"``.

- merged: the names and values of ``merge_and_unload()``'s model, without merging anything in
  the model: each LoRA layer's base weight is gathered, and the delta of each active, unmerged
  adapter (peft's own ``get_delta_weight``, reading the adapter weights gathered exactly, in their
  own dtype) is added to that copy, as peft's merge adds it; a ``modules_to_save`` wrapper gives
  its active copy under the wrapped module's name. peft's ``base_model.model.`` prefix is gone.
- base: the same names with the base weights as they are (what the model computes with its
  adapters disabled); what a rollout engine serving the adapter separately loads once.
- adapter: only the adapter weights, under the names peft's ``save_pretrained`` writes
  (``get_peft_model_state_dict``: no adapter name, the ``base_model.model.`` prefix kept).

Variants whose merge is not a plain sum (DoRA and the others peft implements as a
``lora_variant``), LoRA on raw parameters (``target_parameters``) and other tuner types are
refused by ``merged`` with an error naming the layer, never exported as if plain.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..sharding.state import ShardedParam, ShardState, state_of
from .gather import GatheredBucket
from .plan import Entry, entry


@dataclass
class LoraMerge:
    """Adds ``adapters``' deltas of the LoRA ``layer`` to its gathered base ``part``."""

    layer: nn.Module
    adapters: list[str]
    part: str  # "weight" or "bias"

    @torch.no_grad()
    def apply(self, full: torch.Tensor) -> torch.Tensor:
        states = _adapter_states(self.layer)
        bucket = GatheredBucket(states)  # collective: every rank merges the same layers
        for i, state in enumerate(states):
            state.kept_full = bucket.full(i)
            state.transition(ShardState.GATHERED)  # the layer reads these copies, no collective
        try:
            for adapter in self.adapters:
                if self.part == "weight":
                    full += self.layer.get_delta_weight(adapter)
                elif self.layer.lora_bias[adapter]:
                    full += self.layer.lora_B[adapter].bias * self.layer.scaling[adapter]
        finally:
            for state in states:
                state.kept_full = None
                state.transition(ShardState.SHARDED)
        return full


def _adapter_states(layer: nn.Module) -> list[ShardedParam]:
    """The sharded parameters of ``layer`` outside its base layer (its adapters')."""
    base = {id(p) for p in layer.get_base_layer().parameters()}
    found: dict[int, ShardedParam] = {}
    for param in layer.parameters():
        state = state_of(param)
        if state is not None and id(param) not in base:
            found.setdefault(id(state), state)
    return list(found.values())


def peft_plan(model: nn.Module, values: list[tuple[str, Any]], lora: str) -> list[Entry] | None:
    """The export's entries for a peft model, or None if ``model`` has no peft layers."""
    if "peft" not in sys.modules:  # a model with peft layers has imported peft
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))
    }
    if not layers:
        return None
    if lora == "adapter":
        return _adapter_entries(model, values)
    prefix = _base_model_prefix(model)
    planned = []
    for key, value in values:
        owner, rest = _owner(key, layers)
        if owner is None:
            name = key
            merge = None
        else:
            found = _within_layer(layers[owner], owner, rest, lora)
            if found is None:
                continue
            name, merge = found
        if prefix and not name.startswith(prefix):
            raise ValueError(
                f"zero3: {key!r} lies outside the peft model's base model ({prefix!r}); only "
                "LoRA-style peft models export under the base model's names"
            )
        planned_entry = entry(name[len(prefix) :], value)
        if merge is not None:
            if planned_entry.state is None:
                raise NotImplementedError(
                    f"zero3: merging LoRA into {key!r}, which is not a dim-0 sharded parameter "
                    "(tensor parallel?), is not supported; export with lora='adapter'"
                )
            planned_entry.merge = merge
        planned.append(planned_entry)
    return planned


def _owner(key: str, layers: dict) -> tuple[str | None, str]:
    """The innermost peft layer holding ``key`` and the key's rest below it."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in layers:
            return prefix, ".".join(parts[cut:])
    return None, key


def _within_layer(layer, owner: str, rest: str, lora: str):
    """(exported name, LoraMerge or None) of the key ``owner.rest``, or None to leave it out."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if isinstance(layer, AuxiliaryTrainingWrapper):
        active = None
        if lora == "merged" and not layer.disable_adapters and layer.active_adapters:
            if not isinstance(layer, ModulesToSaveWrapper):
                raise NotImplementedError(
                    f"zero3: {owner!r} is a {type(layer).__name__}; merging it is not "
                    "supported: export with lora='adapter' (and lora='base' once)"
                )
            active = layer.active_adapters[0]
        keep = "original_module." if active is None else f"modules_to_save.{active}."
        return (f"{owner}.{rest[len(keep) :]}", None) if rest.startswith(keep) else None
    if not rest.startswith("base_layer."):
        return None  # the adapter's own weights
    local = rest[len("base_layer.") :]
    name = f"{owner}.{local}"
    if lora == "base":
        return name, None
    if not isinstance(layer, LoraLayer) or hasattr(layer, "parameter_name"):
        raise NotImplementedError(
            f"zero3: merging the {type(layer).__name__} layer {owner!r} is not supported: "
            "export with lora='adapter' (and lora='base' once)"
        )
    adapters = _unmerged_active(layer, owner)
    if local not in ("weight", "bias") or not adapters:
        return name, None
    biased = [a for a in adapters if layer.lora_bias[a]]
    if biased and getattr(layer.get_base_layer(), "bias", None) is None:
        raise RuntimeError(  # peft's merge refuses it too: the delta has nowhere to go
            f"zero3: adapter {biased[0]!r} of {owner!r} has lora_bias=True but the base layer "
            "has no bias; export with lora='adapter'"
        )
    if local == "bias" and not any(layer.lora_bias[a] for a in adapters):
        return name, None
    return name, LoraMerge(layer, adapters, local)


def _unmerged_active(layer, owner: str) -> list[str]:
    """The adapters of ``layer`` whose delta the model adds to its base weight in forward and
    that are not merged into it yet."""
    if layer.disable_adapters:
        if layer.merged:
            raise RuntimeError(
                f"zero3: {owner!r} has adapters merged into its base weight but disabled; "
                "unmerge them first (model.unmerge_adapter())"
            )
        return []
    adapters = [
        a for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters
    ]
    variants = [a for a in adapters if a in layer.lora_variant]
    if variants:
        kind = type(layer.lora_variant[variants[0]]).__name__
        raise NotImplementedError(
            f"zero3: adapter {variants[0]!r} of {owner!r} is a LoRA variant ({kind}) whose merge "
            "is not a plain sum; export with lora='adapter' (and lora='base' once)"
        )
    return adapters


def _base_model_prefix(model: nn.Module) -> str:
    """The qualified name of the wrapped transformers model, with its dot ('' if none)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else getattr(model, "model", None)
    if base is None or base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


def _adapter_entries(model: nn.Module, values: list[tuple[str, Any]]) -> list[Entry]:
    """peft's own selection and names (``get_peft_model_state_dict``) of the active adapter,
    computed on stand-ins that say which entry each name is."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    adapter = getattr(model, "active_adapter", None)
    if not isinstance(adapter, str) or not hasattr(model, "peft_config"):
        raise ValueError(
            "zero3: lora='adapter' exports the active adapter of a PeftModel with one active "
            f"adapter; got {type(model).__name__} with active adapter {adapter!r}"
        )
    stand_ins, source = {}, {}
    for key, value in values:
        if isinstance(value, ShardedParam):
            shape, dtype = value.global_shape, value.local().dtype
        else:
            shape, dtype = tuple(value.shape), value.dtype
        stand_in = torch.empty(shape, dtype=dtype, device="meta")
        stand_ins[key] = stand_in
        source[id(stand_in)] = value
    selected = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter)
    planned = []
    for name, stand_in in selected.items():
        value = source.get(id(stand_in))
        if value is None:
            raise NotImplementedError(
                f"zero3: peft computes the adapter tensor {name!r} instead of selecting it; "
                "exporting it is not supported"
            )
        planned.append(entry(name, value))
    return planned
