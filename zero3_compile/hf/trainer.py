"""``z3hf.Trainer``: a drop-in ``transformers.Trainer`` that trains a zero3-sharded model.

```python
trainer = z3hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                       zero3_options={"bucket_mb": 25})      # or zero3_config="ds_config.json"
trainer.train(resume_from_checkpoint=True)
trainer.save_model(out)                                      # a normal Hugging Face folder
```
What changes against the plain ``Trainer`` (read in transformers' ``trainer.py``):

- the model is sharded (``z3.shard``) unless it is already (``z3hf.from_pretrained``), and
  ``_wrap_model`` returns it compiled with the ``zero3`` backend: the Trainer then hands only the
  optimizer to ``accelerator.prepare``, so no DDP wrapper; ``torch_compile_backend="zero3"`` is
  accepted and accelerate is not asked to compile (its backend list is closed) nor to autocast
  (``bf16`` becomes the model's ``MixedPrecision``: bf16 compute and gathers, fp32 reductions and
  master weights);
- gradient accumulation: gradient sync (the reduce-scatters) only on each optimizer step's last
  micro-batch (``set_requires_gradient_sync``; accelerate's ``no_sync`` does nothing for a model
  it did not wrap);
- checkpoints: ``save_model`` writes the full weights from every rank's shards
  (``z3hf.save_pretrained``, all ranks take part); each checkpoint folder also holds the sealed
  sharded state of model and optimizer (``z3.save_checkpoint``, in ``zero3_state/``), which
  resume (at any world size), ``load_best_model_at_end`` and the optimizer state load from;
  the scheduler, RNG and trainer state are Hugging Face's own files.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.nn as nn
import transformers

from ..compiler.options import Options
from ..frontend.accumulation import set_requires_gradient_sync
from ..frontend.mixed_precision import MixedPrecision, set_mixed_precision
from ..frontend.module import Zero3Module
from ..frontend.shard import shard
from ..io.checkpoint import load_checkpoint, save_checkpoint
from ..offload.optimizer import offload_optimizer
from .deepspeed_config import Translated, translate
from .generation import mark_sharded
from .saving import save_pretrained

ZERO3_STATE = "zero3_state"
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for zero3_compile (see the module docstring).

    zero3_options: ``torch.compile(..., backend="zero3", options=...)`` (``z3.Options``).
    zero3_config: a DeepSpeed ZeRO-3 configuration (path or dict), translated; ``zero3_options``
        given too override what it sets.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *positional,
        zero3_options: dict[str, Any] | None = None,
        zero3_config: str | os.PathLike | dict | None = None,
        **kwargs,
    ):
        if model is None:
            raise ValueError("zero3: z3hf.Trainer needs a model (model_init is not supported)")
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        args = copy.copy(args)  # the caller's arguments stay as given
        translated = translate(zero3_config, args) if zero3_config is not None else Translated()
        for key, value in translated.args.items():
            setattr(args, key, value)
        self._zero3_notes = translated.notes
        self._zero3_optimizer_offload = translated.optimizer_offload
        self._zero3_scaler = translated.scaler
        self._zero3_options = {**translated.options, **(zero3_options or {})}
        Options.from_dict(self._zero3_options)  # unknown or bad options fail here, not later
        self._zero3_mode = _compile_settings(args)
        policy = _policy(args)
        if isinstance(model, Zero3Module):
            if policy is not None and model.zero3_runtime.policy != policy:
                set_mixed_precision(model, policy)
        else:
            shard_kwargs = dict(translated.shard)
            if policy is not None:
                shard_kwargs["mp_policy"] = policy
            model = shard(model.to(args.device), **shard_kwargs)
        mark_sharded(model)
        self._zero3_compiled = None
        self._zero3_syncing = True
        super().__init__(model, args, *positional, **kwargs)

    # ------------------------------------------------------------------ setup

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        # The model's MixedPrecision casts; accelerate keeps "fp16" only for its loss scaling
        # (scaled backward, unscale before clipping, skipped steps), never autocast: the model
        # does not go through accelerator.prepare.
        built["mixed_precision"] = "fp16" if self.args.fp16 else "no"
        from accelerate.utils import TorchDynamoPlugin

        built["dynamo_plugin"] = TorchDynamoPlugin(backend="no")  # compiled in _wrap_model
        return built

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        if self.args.fp16 and (accelerator.scaler is None or self._zero3_scaler):
            # accelerate scales losses on accelerators only; gradients in fp16 need it anywhere
            accelerator.scaler = torch.amp.GradScaler(accelerator.device.type, **self._zero3_scaler)
            accelerator.native_amp = True

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._zero3_compiled is None:
            self._zero3_compiled = torch.compile(
                self.model, backend="zero3", options=self._zero3_options, mode=self._zero3_mode
            )
        return self._zero3_compiled

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._zero3_optimizer_offload is not None and not getattr(
            optimizer, "_zero3_tiled", False
        ):
            self.optimizer = offload_optimizer(optimizer, **self._zero3_optimizer_offload)
        _check_in_backward(self.optimizer, self.args)
        return self.optimizer

    # ------------------------------------------------------------------ training

    def training_step(self, model, inputs, num_items_in_batch=None):
        sync = bool(self.accelerator.sync_gradients)
        if sync != self._zero3_syncing:  # reduce-scatter only on the step's last micro-batch
            set_requires_gradient_sync(self.model, sync)
            self._zero3_syncing = sync
        return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder of the full weights; every rank takes part (rank 0 writes)."""
        output_dir = output_dir or self.args.output_dir
        save_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(os.path.join(output_dir, ZERO3_STATE), self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------------ loading

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_checkpoint(_state_dir(resume_from_checkpoint), model or self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_checkpoint(_state_dir(checkpoint), self.model, self.optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        load_checkpoint(_state_dir(self.state.best_model_checkpoint), self.model)


def _check_in_backward(optimizer, args) -> None:
    """An optimizer given as ``offload_optimizer(..., in_backward=True)`` steps during the
    backward: refuse, before the first step, the arguments that need the gradients after it."""
    offload = getattr(getattr(optimizer, "optimizer", optimizer), "_zero3_offload", None)
    if getattr(offload, "in_backward", None) is None:
        return
    needs = []
    if args.max_grad_norm:
        needs.append(f"max_grad_norm={args.max_grad_norm} (gradient clipping): max_grad_norm=0")
    if args.gradient_accumulation_steps > 1:
        needs.append(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: "
            "gradient_accumulation_steps=1"
        )
    if args.fp16:
        needs.append("fp16 (loss scaling unscales the gradients): bf16=True instead")
    if needs:
        raise ValueError(
            "zero3: the optimizer steps each parameter during the backward "
            "(offload_optimizer(in_backward=True)), so the Trainer cannot use its gradients "
            "afterwards; set TrainingArguments " + "; ".join(needs) + ", or use in_backward=False"
        )


def _state_dir(checkpoint: str) -> str:
    path = os.path.join(checkpoint, ZERO3_STATE)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"zero3: {checkpoint!r} has no {ZERO3_STATE}/ folder: it was not written by "
            "zero3_compile.hf.Trainer (a plain Hugging Face folder of full weights loads with "
            "z3hf.from_pretrained instead)"
        )
    return path


def _compile_settings(args) -> str | None:
    """Take the compile settings from the arguments (we compile ourselves)."""
    backend = args.torch_compile_backend
    if args.torch_compile and backend not in (None, "zero3", "inductor"):
        raise ValueError(
            f"zero3: TrainingArguments(torch_compile_backend={backend!r}): z3hf.Trainer compiles "
            "the model with the zero3 backend; pass torch_compile_backend='zero3' (codegen through "
            "zero3_options={'codegen': ...})"
        )
    mode = args.torch_compile_mode
    args.torch_compile = False
    args.torch_compile_backend = None
    args.torch_compile_mode = None
    return mode


def _policy(args) -> MixedPrecision | None:
    if getattr(args, "fp16", False) and getattr(args, "bf16", False):
        raise ValueError("zero3: TrainingArguments(fp16=True, bf16=True): choose one")
    if getattr(args, "fp16", False):
        # fp16 gathers and compute, fp32 reduction and master shards; the loss is scaled by
        # accelerate's GradScaler (see create_accelerator_and_postprocess)
        return MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if getattr(args, "bf16", False):
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None
