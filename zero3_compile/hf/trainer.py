"""``z3hf.Trainer``: a drop-in ``transformers.Trainer`` that trains a zero3-sharded model.

```python
trainer = z3hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                       zero3_options={"bucket_mb": 25})      # or zero3_config="ds_config.json"
trainer.train(resume_from_checkpoint=True)
trainer.save_model(out)                                      # a normal Hugging Face folder
```
What changes against the plain ``Trainer`` (read in transformers' ``trainer.py``):

- the model is sharded (``z3.shard``) unless it is already (``z3hf.from_pretrained``; a peft
  model made after sharding counts: ``peft.sharded_runtime``), and ``_wrap_model`` returns it
  compiled with the ``zero3`` backend: the Trainer then hands only the
  optimizer to ``accelerator.prepare``, so no DDP wrapper; ``torch_compile_backend="zero3"`` is
  accepted and accelerate is not asked to compile (its backend list is closed) nor to autocast
  (``bf16`` becomes the model's ``MixedPrecision``: bf16 compute and gathers, fp32 reductions and
  master weights);
- gradient accumulation: gradient sync (the reduce-scatters) only on each optimizer step's last
  micro-batch (``set_requires_gradient_sync``; accelerate's ``no_sync`` does nothing for a model
  it did not wrap);
- checkpoints: ``save_model`` writes the full weights from every rank's shards
  (``z3hf.save_pretrained``, all ranks take part; a peft model's adapter, or merged on request);
  each checkpoint folder also holds the sealed sharded state of model and optimizer
  (``z3.save_checkpoint``, in ``zero3_state/``), which resume (at any world size),
  ``load_best_model_at_end`` and the optimizer state load from; the scheduler, RNG and trainer
  state are Hugging Face's own files. Its ``optimizer.pt`` is a marker that a plain ``Trainer``
  cannot load (it would otherwise resume with a fresh optimizer in silence);
- arguments: by keyword or by position; mixed with another ``Trainer`` subclass (TRL's), in
  either order, the other class's arguments keep their positions (``_by_keyword``) and the
  models it builds are sharded (``trl.py``).

Importing this module makes ``accelerate.Accelerator.prepare_model`` refuse a sharded model for
training (a plain ``Trainer``, TRL trainer or ``accelerator.prepare`` would wrap it in DDP).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

from ..compiler.options import Options
from ..frontend.accumulation import set_requires_gradient_sync
from ..frontend.mixed_precision import MixedPrecision, set_mixed_precision
from ..frontend.module import Zero3Module
from ..frontend.shard import shard
from ..io.checkpoint import load_checkpoint, save_checkpoint
from ..offload.optim import offload_optimizer
from .deepspeed_config import Translated, translate
from .generation import mark_sharded
from .peft import sharded_runtime
from .saving import save_pretrained

log = logging.getLogger(__name__)

ZERO3_STATE = "zero3_state"
SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for zero3_compile (see the module docstring).

    zero3_options: ``torch.compile(..., backend="zero3", options=...)`` (``z3.Options``).
    zero3_config: a DeepSpeed ZeRO-3 configuration (path or dict), translated; ``zero3_options``
        given too override what it sets.

    Every other argument is the base class's, by keyword or by position. Mixed with another
    ``transformers.Trainer`` subclass (a TRL trainer, in either order: ``zero3_compile.hf.trl``
    has the usual ones), the other class's own arguments are unchanged.

    Example:
        ```python
        model = z3hf.from_pretrained(AutoModelForCausalLM, "path/to/model")  # or any model
        trainer = z3hf.Trainer(model=model, args=TrainingArguments("out"), train_dataset=ds,
                               zero3_options={"bucket_mb": 25})  # or zero3_config="ds_config.json"
        trainer.train(resume_from_checkpoint=True)
        trainer.save_model("out/final")  # a normal Hugging Face folder
        ```
    """

    _zero3_args_class: type | None = None  # default arguments when none are given (TRL's config)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # another Trainer's __init__ runs before ours (``class X(DPOTrainer, z3hf.Trainer)``):
        # it knows no zero3 arguments, so the subclass takes them first
        if "__init__" not in cls.__dict__ and _next_init(cls, cls) is not Trainer.__init__:
            cls.__init__ = _entry_init(cls)

    def __init__(
        self,
        *args,
        zero3_options: dict[str, Any] | None = None,
        zero3_config: str | os.PathLike | dict | None = None,
        **kwargs,
    ):
        if self.__dict__.get("_zero3") is not None:  # reached from a mixed-in trainer's __init__
            if zero3_options is not None or zero3_config is not None:
                raise TypeError(
                    "zero3: zero3_options/zero3_config are given to the outermost class"
                )
            named = _by_keyword(transformers.Trainer.__init__, args, kwargs)
            named["model"] = self._zero3_adopt(named.get("model"))
            super().__init__(**named)
            return
        named = _by_keyword(_next_init(type(self), Trainer), args, kwargs)
        self._zero3_enter(named, zero3_options, zero3_config)
        named["model"] = self._zero3_adopt(named.get("model"))
        with self._zero3_building():
            super().__init__(**named)
        self._zero3_leave()

    # ------------------------------------------------------------------ construction

    def _zero3_enter(self, named: dict, zero3_options, zero3_config) -> None:
        """Translate the configuration into (a copy of) the arguments; keep what zero3 needs."""
        args = named.get("args")
        if args is None:
            args = self._zero3_default_args(named)
        args = copy.copy(args)  # the caller's arguments stay as given
        translated = translate(zero3_config, args) if zero3_config is not None else Translated()
        for key, value in translated.args.items():
            setattr(args, key, value)
        options = {**translated.options, **(zero3_options or {})}
        Options.from_dict(options)  # unknown or bad options fail here, not later
        policy = _policy(args)
        shard_kwargs = dict(translated.shard)
        if policy is not None:
            shard_kwargs["mp_policy"] = policy
        self._zero3 = _Setup(
            options=options,
            notes=list(translated.notes),
            optimizer_offload=translated.optimizer_offload,
            scaler=translated.scaler,
            shard_kwargs=shard_kwargs,
            policy=policy,
            mode=_compile_settings(args),
            device=args.device,
            deepspeed=translated,
        )
        named["args"] = args
        self._zero3_compiled = None
        self._zero3_syncing = True

    def _zero3_default_args(self, named: dict):
        if self._zero3_args_class is None:
            return transformers.TrainingArguments(output_dir="trainer_output")
        model = named.get("model")
        name = (
            model
            if isinstance(model, str)
            else getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
        )
        suffix = self._zero3_args_class.__name__.removesuffix("Config")
        return self._zero3_args_class(output_dir=f"{os.path.basename(str(name))}-{suffix}")

    def _zero3_adopt(self, model):
        """The model sharded (already, or now in place), with the arguments' precision; a model
        name is left to a mixed-in trainer that loads it (``trl.py`` loads it sharded)."""
        if model is None:
            raise ValueError("zero3: z3hf.Trainer needs a model (model_init is not supported)")
        if isinstance(model, str):
            return model
        setup = self._zero3
        runtime = sharded_runtime(model)
        if runtime is None:
            model = shard(model.to(setup.device), **setup.shard_kwargs)
        elif setup.policy is not None and runtime.policy != setup.policy:
            set_mixed_precision(model, setup.policy)
        mark_sharded(model)
        setup.deepspeed.set_leaf_modules(model)  # a DeepSpeed config's leaf_module section
        return model

    def _zero3_building(self):
        """Around a mixed-in trainer's ``__init__``: the models it loads are sharded."""
        from .trl import building

        return building(self)

    def _zero3_leave(self) -> None:
        """After every ``__init__``: the model the base classes settled on, and a reference
        model a TRL trainer keeps, sharded."""
        from .trl import adopt_reference

        if sharded_runtime(self.model) is None:
            raise RuntimeError(
                "zero3: the trainer's model is not sharded after construction (a mixed-in "
                "trainer replaced it); report this with the trainer class"
            )
        mark_sharded(self.model)
        adopt_reference(self)

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
        if self.args.fp16 and (accelerator.scaler is None or self._zero3.scaler):
            # accelerate scales losses on accelerators only; gradients in fp16 need it anywhere
            accelerator.scaler = torch.amp.GradScaler(accelerator.device.type, **self._zero3.scaler)
            accelerator.native_amp = True

    def _move_model_to_device(self, model, device) -> None:
        # the shards are where shard()/from_pretrained put them: move only if they are not (a
        # no-op .to() would still rebuild every parameter, offloaded ones included)
        target = torch.device(device)
        if any(not _same_device(p.device, target) for p in model.parameters()):
            super()._move_model_to_device(model, device)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self._zero3_compiled is None:
            self._zero3_compiled = torch.compile(
                self.model, backend="zero3", options=self._zero3.options, mode=self._zero3.mode
            )
        return self._zero3_compiled

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        groups = getattr(optimizer, "param_groups", None)
        if groups is not None and not all(g["params"] for g in groups):
            # a group left empty (a frozen base: no trainable norm weights to spare from decay)
            # breaks torch's flattened optimizer state dict, which the checkpoints use
            groups[:] = [g for g in groups if g["params"]]
        if self._zero3.optimizer_offload is not None and not getattr(
            optimizer, "_zero3_tiled", False
        ):
            self.optimizer = offload_optimizer(optimizer, **self._zero3.optimizer_offload)
        _check_in_backward(self.optimizer, self.args)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        schedule = self._zero3.deepspeed.lr_schedule  # a DeepSpeed config's, as DeepSpeed runs it
        if schedule is not None and self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            warmup = self.args.get_warmup_steps(num_training_steps)
            self.lr_scheduler = schedule.build(optimizer, num_training_steps, warmup)
        return super().create_scheduler(num_training_steps, optimizer)

    # ------------------------------------------------------------------ training

    def training_step(self, model, inputs, num_items_in_batch=None):
        sync = bool(self.accelerator.sync_gradients)
        if sync != self._zero3_syncing:  # reduce-scatter only on the step's last micro-batch
            set_requires_gradient_sync(self.model, sync)
            self._zero3_syncing = sync
        return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ saving

    def save_model(
        self, output_dir: str | None = None, _internal_call: bool = False, *,
        merge_adapters: bool = False,
    ) -> None:  # fmt: skip
        """A Hugging Face folder of the full weights (a peft model: its adapters, or with
        ``merge_adapters=True`` the merged model); every rank takes part (rank 0 writes)."""
        output_dir = output_dir or self.args.output_dir
        save_pretrained(self.model, output_dir, merge_adapters=merge_adapters)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(os.path.join(output_dir, ZERO3_STATE), self.model, self.optimizer)
        if self.args.should_save:
            if self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            write_resume_refusal(output_dir)

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


@dataclasses.dataclass
class _Setup:
    """What ``Trainer.__init__`` derived from the zero3 arguments and ``TrainingArguments``."""

    options: dict
    notes: list
    optimizer_offload: dict | None
    scaler: dict
    shard_kwargs: dict  # for the models the trainer shards or loads (z3.shard's arguments)
    policy: MixedPrecision | None
    mode: str | None
    device: torch.device
    deepspeed: Translated  # the DeepSpeed config's translation (empty without one)


def _next_init(cls: type, after: type):
    """The ``__init__`` that ``super(after, self).__init__`` reaches for an instance of ``cls``."""
    mro = cls.__mro__
    for klass in mro[mro.index(after) + 1 :]:
        if "__init__" in klass.__dict__:
            return klass.__dict__["__init__"]
    return object.__init__


def _by_keyword(init, args: tuple, kwargs: dict) -> dict:
    """``args`` and ``kwargs`` as ``init`` would bind them, every one by name (a TRL trainer
    takes ``(model, ref_model | reward_funcs, args, ...)``: positions differ between classes)."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(init)
    try:
        bound = signature.bind_partial(None, *args, **kwargs)  # None: self
    except TypeError as error:
        raise TypeError(f"zero3: {init.__qualname__}: {error}") from error
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)))  # self
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and named.get(name):
            raise TypeError(f"zero3: {init.__qualname__} takes too many positional arguments")
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            named.pop(name, None)
    return named


def _entry_init(cls: type):
    """The ``__init__`` of a class whose first base ``__init__`` is another trainer's: it takes
    the zero3 arguments, binds the rest by name, and runs that ``__init__`` (which reaches
    ``Trainer.__init__`` through ``super()`` with the model it prepared)."""
    following = _next_init(cls, cls)

    def __init__(self, *args, zero3_options=None, zero3_config=None, **kwargs):
        named = _by_keyword(following, args, kwargs)
        Trainer._zero3_enter(self, named, zero3_options, zero3_config)
        with self._zero3_building():
            super(cls, self).__init__(**named)
        self._zero3_leave()

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__doc__ = f"``{following.__qualname__}``'s arguments, and zero3_options, zero3_config."
    return __init__


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cpu" and "cpu:0" are one device; an accelerator without an index is the current one
    if a.type != b.type:
        return False
    return a.type == "cpu" or a.index is None or b.index is None or a.index == b.index


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ----------------------------------------------------------------------- the plain Trainer's paths

REFUSAL = "optimizer.pt"  # where a plain Trainer looks for the optimizer state


class ResumeWithZero3Trainer:
    """Stands in ``optimizer.pt`` of a zero3 checkpoint: a plain ``transformers.Trainer`` that
    resumes from it would otherwise find no optimizer state and start a fresh optimizer in
    silence. Loading the file fails naming the fix: torch's ``weights_only`` refusal names the
    function below, and loading it otherwise runs it (it raises)."""

    def __reduce__(self):
        return (resume_with_zero3_compile_hf_Trainer, ())


def resume_with_zero3_compile_hf_Trainer():  # noqa: N802  (its name is the message)
    raise RuntimeError(
        "zero3: this checkpoint was written by zero3_compile.hf.Trainer; its optimizer state is "
        f"sharded in {ZERO3_STATE}/. Resume it with zero3_compile.hf.Trainer (or "
        "zero3_compile.hf.trl's trainers), not with a plain transformers.Trainer"
    )


def write_resume_refusal(folder: str) -> None:
    torch.save(ResumeWithZero3Trainer(), os.path.join(folder, REFUSAL))


def _refuse_sharded_prepare(original):
    """``Accelerator.prepare_model`` refusing a zero3 model for training: accelerate would wrap
    it in DDP (a DTensor error on GPUs, a broadcast error on CPU), and a plain ``Trainer`` or TRL
    trainer would then train it as a replicated model."""

    @functools.wraps(original)
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if not evaluation_mode and _holds_shards(model):
            raise TypeError(
                "zero3: this model is sharded by zero3_compile; accelerate and a plain "
                "transformers.Trainer / TRL trainer would wrap it in DistributedDataParallel. "
                "Train it with zero3_compile.hf.Trainer, zero3_compile.hf.trl's trainers "
                "(SFTTrainer, DPOTrainer, GRPOTrainer, RewardTrainer), or in your own loop with "
                "zero3_compile.hf.prepare(accelerator, model, ...)"
            )
        return original(self, model, device_placement=device_placement,
                        evaluation_mode=evaluation_mode)  # fmt: skip

    prepare_model._zero3_refusing = True
    return prepare_model


def _holds_shards(model: nn.Module) -> bool:
    if not isinstance(model, nn.Module):
        return False
    return any(isinstance(m, Zero3Module) for m in model.modules())


def _install_refusals() -> None:
    from accelerate import Accelerator

    if not getattr(Accelerator.prepare_model, "_zero3_refusing", False):
        Accelerator.prepare_model = _refuse_sharded_prepare(Accelerator.prepare_model)


_install_refusals()


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
