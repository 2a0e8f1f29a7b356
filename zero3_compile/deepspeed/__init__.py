"""DeepSpeed's user APIs under their DeepSpeed names, on zero3 models:
``from zero3_compile import deepspeed as z3ds``.

- ``GatheredParameters(params, modifier_rank=None | r, enabled=True)``: parameters gathered whole
  for a block; with ``modifier_rank`` that rank's writes reach every rank's shards
  (``gathered.py``, over ``z3.gathered``);
- ``safe_get_full_fp32_param``, ``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their
  ``safe_get_local_*`` forms and the ``safe_set_full_*`` / ``safe_set_local_*`` counterparts
  (``fragments.py``);
- ``LossScaler``: a static fp16 loss scale, DeepSpeed's ``"fp16": {"loss_scale": N}``
  (``loss_scale.py``);
- ``offload_states(model, optimizer)`` / ``reload_states(model, optimizer)``: DeepSpeed's
  ``engine.offload_states()`` / ``reload_states()`` between RLHF phases (``z3.offload_states``);
- ``python -m zero3_compile.deepspeed.zero_to_fp32 CKPT OUT``: a ``z3.save_checkpoint``
  directory as one consolidated safetensors (or ``.bin``) file, offline
  (``zero_to_fp32.py``; also ``convert_zero_checkpoint_to_fp32_state_dict`` and
  ``get_fp32_state_dict_from_zero_checkpoint``).

The DeepSpeed package itself is not needed (nor imported). The mapping of each DeepSpeed call to
its zero3 counterpart: ``docs/guides/deepspeed-api.md``.
"""

from ..offload import offload_states, reload_states
from .fragments import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from .gathered import GatheredParameters
from .loss_scale import LossScaler

# imported on first use: ``python -m zero3_compile.deepspeed.zero_to_fp32`` runs that module as
# __main__, which must not be imported already by its package
_CHECKPOINT_NAMES = (
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "offload_states",
    "reload_states",
)


def __getattr__(name: str):
    if name in _CHECKPOINT_NAMES:
        from . import zero_to_fp32

        return getattr(zero_to_fp32, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GatheredParameters",
    "LossScaler",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "offload_states",
    "reload_states",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
