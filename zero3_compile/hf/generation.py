"""``generate`` on a sharded model: ranks stay in step.

Every forward of a sharded model issues collectives (each parameter read is a gather), so every
rank must run as many forward passes as the others. Hugging Face's ``generate`` keeps finished
ranks running dummy steps until all are done when given ``synced_gpus=True``; ``mark_sharded``
gives each Hugging Face model in a sharded model a ``generate`` that passes it (unless the caller
chose), so ranks with prompts of other lengths, finishing at other steps, never hang. Not through
the ``_is_fsdp_managed_module`` flag that ``generate`` also reads: dynamo takes that flag for
FSDP1's and breaks the graph at the model, so each decoder layer became a frame of its own,
recompiled per layer until dynamo's limit. For speed, gather the model once instead: ``with
z3.gathered(model): model.generate(...)`` runs no collective at all (and needs no step-keeping).
"""

from __future__ import annotations

import types

import torch.distributed as dist
import torch.nn as nn

from ..sharding.state import ShardState


def mark_sharded(model: nn.Module) -> None:
    """Give the Hugging Face models in ``model`` a ``generate`` that keeps ranks in step (see the
    module docstring)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and "generate" not in module.__dict__:
            if hasattr(type(module), "generate"):
                module.generate = types.MethodType(_generate_in_step, module)


def _generate_in_step(self, *args, **kwargs):
    if kwargs.get("synced_gpus") is None and _in_step(self):
        kwargs["synced_gpus"] = True
    return type(self).generate(self, *args, **kwargs)


def _in_step(module: nn.Module) -> bool:
    """Sharded, not inside ``z3.gathered``, more than one rank: forwards must stay in step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    for _, state in module.sharded_parameters():
        return state.state is not ShardState.GATHERED
    return False
