"""``generate`` on a sharded model: ranks stay in step.

Every forward of a sharded model issues collectives (each parameter read is a gather), so every
rank must run as many forward passes as the others. Hugging Face's ``generate`` already keeps
finished ranks running dummy steps until all are done (``synced_gpus``) for models whose
parameters are sharded across ranks; it recognises them by the ``_is_fsdp_managed_module`` flag,
which ``mark_sharded`` sets (the flag means "sharded, forward passes must stay in step"; nothing
else in transformers reads it). So ranks with prompts of other lengths, finishing at other steps,
never hang. Dynamo reads the same flag: it takes the module for FSDP1's and, without
``_fsdp_use_orig_params``, breaks the graph there, so each decoder layer became a frame of its
own, recompiled per layer until dynamo's limit; the flag is therefore false while dynamo traces. For speed, gather the model once instead: ``with z3.gathered(model):
model.generate(...)`` runs no collective at all (and needs no step-keeping).
"""

from __future__ import annotations

import torch.nn as nn

from ..compat import dynamo_is_tracing
from ..sharding.state import ShardState


def mark_sharded(model: nn.Module) -> None:
    """Flag the Hugging Face models in ``model`` as sharded (see the module docstring): a
    property of their generated classes, false inside ``z3.gathered`` (nothing to keep in step
    then, not even the per-step check that all ranks finished)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if (
            isinstance(module, PreTrainedModel)
            and "_is_fsdp_managed_module" not in type(module).__dict__
        ):
            type(module)._is_fsdp_managed_module = property(_in_step)


def _in_step(module: nn.Module) -> bool:
    if dynamo_is_tracing():
        return False
    for _, state in module.sharded_parameters():
        return state.state is not ShardState.GATHERED
    return False
