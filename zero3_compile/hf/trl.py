"""TRL's trainers on zero3: ``z3hf.trl.SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``,
``RewardTrainer``.

```python
from zero3_compile.hf import trl as z3trl

trainer = z3trl.DPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs,
                           processing_class=tokenizer, zero3_options={"codegen": "inductor"})
trainer.train()
```
Each is the TRL trainer with ``z3hf.Trainer`` between it and ``transformers.Trainer``
(``class DPOTrainer(trl.DPOTrainer, z3hf.Trainer)``): TRL's arguments are unchanged, by keyword
or by position, and ``zero3_options`` / ``zero3_config`` are ``z3hf.Trainer``'s. TRL prepares the
model (loads it from a name, applies ``peft_config``) and hands it to ``z3hf.Trainer``, which
shards it unless it is already (``z3hf.from_pretrained``, before or after ``get_peft_model``).
Writing ``class X(trl.SomeTrainer, z3hf.Trainer)`` (or the reverse order) works the same way for
TRL trainers not listed here.

What zero3 changes in TRL's construction (read in trl 1.16's ``trainer/*.py``):

- models TRL loads from a name (``create_model_from_path``: the policy given as a string, DPO's
  and GRPO's reference model built from the policy's name) are loaded with
  ``z3hf.from_pretrained``: sharded as they load, never whole on a rank;
- a reference model (``ref_model`` given, already sharded or not, or built by TRL) is sharded
  with the policy's group and precision and compiled with the zero3 backend. With peft and no
  ``ref_model`` TRL disables the adapter for the reference pass, as it does under DeepSpeed;
- GRPO generates with the model gathered once per generation (``z3.gathered``: no collective per
  token, ranks finish at other lengths freely) when ``args.ds3_gather_for_generation`` is True
  (TRL's default), else on the sharded model, each layer gathered as it runs, ranks kept in step
  (``synced_gpus``): for models that do not fit gathered.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn as nn

from .._torch.dynamo import uncompiled
from ..frontend.gathered import gathered
from ..frontend.mixed_precision import set_mixed_precision
from ..frontend.shard import shard
from ..sharding.state import ShardState
from .generation import mark_sharded
from .peft import sharded_runtime

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- construction


@contextlib.contextmanager
def building(trainer) -> Iterator[None]:
    """For the ``__init__`` of a trainer mixed with TRL's: the models TRL loads from a name are
    loaded sharded (``create_model_from_path`` of the trainer's modules, for the block only)."""
    patched = []
    for klass in type(trainer).__mro__:
        module = sys.modules.get(klass.__module__)
        original = getattr(module, "create_model_from_path", None)
        if original is None or getattr(original, "_zero3_loader", False):
            continue
        module.create_model_from_path = _sharded_loader(trainer, original)
        patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            module.create_model_from_path = original


def _sharded_loader(trainer, original):
    @functools.wraps(original)
    def create_model_from_path(model_id: str, architecture=None, **kwargs):
        kwargs["device_map"] = None  # zero3 places the shards
        loader = _ShardedLoad(architecture or _architecture(model_id, kwargs), trainer)
        return original(model_id, loader, **kwargs)

    create_model_from_path._zero3_loader = True
    return create_model_from_path


class _ShardedLoad:
    """Stands for a model class in TRL's ``create_model_from_path``: its ``from_pretrained`` is
    ``z3hf.from_pretrained`` of the class, with the trainer's sharding arguments."""

    def __init__(self, model_class, trainer):
        self.model_class = model_class
        self.trainer = trainer

    def from_pretrained(self, model_id, *args, **kwargs):
        from .loading import from_pretrained

        loaded = self.trainer.__dict__.setdefault("_zero3_loaded", [])
        if loaded:  # the policy is loaded: this is another model beside it (the reference)
            shard_kwargs = _reference_kwargs(self.trainer)
        else:
            shard_kwargs = self.trainer._zero3.shard_kwargs
        model = from_pretrained(self.model_class, model_id, *args, **shard_kwargs, **kwargs)
        loaded.append(model_id)
        return model


def _reference_kwargs(trainer) -> dict:
    """The sharding arguments for a model beside the policy (the reference): the policy's group
    and precision, its own offload files (two models in one ``Offload(path=...)`` folder would
    share a file)."""
    shard_kwargs = {
        k: v for k, v in trainer._zero3.shard_kwargs.items() if k not in ("group", "mesh")
    }
    policy = trainer.__dict__.get("model")
    runtime = sharded_runtime(policy) if isinstance(policy, nn.Module) else None
    if runtime is not None:
        shard_kwargs["mesh"] = runtime.dp.mesh
    offload = shard_kwargs.get("offload")
    if offload is not None and offload.path is not None:
        shard_kwargs["offload"] = replace(offload, path=os.path.join(offload.path, "ref"))
    return shard_kwargs


def _architecture(model_id: str, kwargs: dict):
    """The class TRL would pick for a checkpoint given without one: the checkpoint's own
    architecture where transformers has it, else ``AutoModelForCausalLM``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(
        model_id, trust_remote_code=kwargs.get("trust_remote_code", False)
    )
    names = getattr(config, "architectures", None) or []
    found = getattr(transformers, names[0], None) if names else None
    return found or transformers.AutoModelForCausalLM


def adopt_reference(trainer) -> None:
    """The trainer's ``ref_model`` (a TRL trainer's reference model), sharded like the policy
    and compiled with the zero3 backend; nothing when there is none."""
    ref = getattr(trainer, "ref_model", None)
    if not isinstance(ref, nn.Module):
        return
    model = uncompiled(ref)
    setup = trainer._zero3
    runtime = sharded_runtime(model)
    if runtime is None:
        shard(model.to(setup.device), **_reference_kwargs(trainer))
    elif setup.policy is not None and runtime.policy != setup.policy:
        set_mixed_precision(model, setup.policy)
    mark_sharded(model)
    if model is ref:
        trainer.ref_model = torch.compile(model, backend="zero3", options=setup.options)


def is_reference_sharded(trainer) -> bool:
    """Every parameter of the trainer's reference model is a shard (for tests and checks)."""
    ref = getattr(trainer, "ref_model", None)
    return ref is not None and sharded_runtime(uncompiled(ref)) is not None


# --------------------------------------------------------------------------- generation


@contextlib.contextmanager
def for_generation(model: nn.Module, gather: bool) -> Iterator[None]:
    """Around a generation inside training: the model gathered once (``gather``), else left
    sharded (each forward gathers layer by layer; ``generate`` keeps ranks in step).

    Inside an accumulation window (gradient sync off, ``z3.set_requires_gradient_sync``) sync is
    turned on for the generation when no gradient is pending yet (a generation at the start of
    an optimizer step, as GRPO's); with gradients pending the model is not gathered."""
    model = uncompiled(model)
    if not gather:
        yield
        return
    states = {id(s): s for _, s in _sharded(model)}.values()
    accumulating = [s for s in states if s.state is not ShardState.SHARDED]
    if accumulating:
        if any(s.grad_sink is not None and s.grad_sink.grad is not None for s in states) or any(
            s.state is not ShardState.ACCUMULATING for s in accumulating
        ):
            log.info("zero3: generating on the sharded model (gradients are pending unreduced)")
            yield
            return
    from ..frontend.accumulation import set_requires_gradient_sync

    if accumulating:
        set_requires_gradient_sync(model, True)
    try:
        with gathered(model):
            yield
    finally:
        if accumulating:
            set_requires_gradient_sync(model, False)


def _sharded(model: nn.Module):
    from ..sharding.state import module_state

    for module in model.modules():
        state = module_state(module)
        if state is not None:
            yield from state.params.items()


# --------------------------------------------------------------------------- the trainers


def _trainers() -> dict[str, type]:
    import trl

    from .trainer import Trainer

    class SFTTrainer(trl.SFTTrainer, Trainer):
        """``trl.SFTTrainer`` on zero3 (see ``zero3_compile.hf.trl``)."""

        _zero3_args_class = trl.SFTConfig

    class DPOTrainer(trl.DPOTrainer, Trainer):
        """``trl.DPOTrainer`` on zero3; the reference model is sharded (see
        ``zero3_compile.hf.trl``)."""

        _zero3_args_class = trl.DPOConfig

    class GRPOTrainer(trl.GRPOTrainer, Trainer):
        """``trl.GRPOTrainer`` on zero3; generation gathered or streamed by
        ``args.ds3_gather_for_generation`` (see ``zero3_compile.hf.trl``)."""

        _zero3_args_class = trl.GRPOConfig

        def _generate_single_turn(self, *args, **kwargs):
            with for_generation(self.model, bool(self.args.ds3_gather_for_generation)):
                return super()._generate_single_turn(*args, **kwargs)

    class RewardTrainer(trl.RewardTrainer, Trainer):
        """``trl.RewardTrainer`` on zero3 (see ``zero3_compile.hf.trl``)."""

        _zero3_args_class = trl.RewardConfig

    classes = {}
    for klass in (SFTTrainer, DPOTrainer, GRPOTrainer, RewardTrainer):
        klass.__module__ = __name__
        klass.__qualname__ = klass.__name__
        classes[klass.__name__] = klass
    return classes


_NAMES = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RewardTrainer")


@functools.cache
def _built() -> dict[str, type]:
    return _trainers()


def __getattr__(name: str):
    # built on first use: importing zero3_compile.hf does not import trl
    if name in _NAMES:
        return _built()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_NAMES, "for_generation", "is_reference_sharded"]
