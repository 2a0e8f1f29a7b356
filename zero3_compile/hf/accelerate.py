"""accelerate with a zero3 model: ``from zero3_compile.hf import Accelerator``, nothing else changes.

```python
from zero3_compile.hf import Accelerator        # was: from accelerate import Accelerator
accelerator = Accelerator(gradient_accumulation_steps=2)
model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
for batch in dl:
    with accelerator.accumulate(model):
        accelerator.backward(model(**batch).loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad()
accelerator.save_state("ckpt")                    # sharded; load_state resumes bit for bit
```
``prepare`` shards each model (``z3.shard``) and compiles it with the zero3 backend instead of
wrapping it in DDP; an optimizer built on the unsharded parameters is pointed at the shards.
``accumulate`` / ``no_sync`` turn the gradient reduce-scatter off between optimizer steps,
``save_state`` / ``load_state`` write the model and optimizer shards with
``z3.save_checkpoint`` beside accelerate's own files, ``get_state_dict`` / ``save_model`` gather
the full weights (every rank calls them).

Under ``accelerate launch --use_deepspeed --zero_stage 3 --deepspeed_config_file ds.json`` (or
``Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))``) the DeepSpeed settings are translated
(``deepspeed_config.py``) and DeepSpeed's engine behaviour is kept: its accumulation steps win,
its ``gradient_clipping`` clips at each optimizer step (``clip_grad_norm_`` only returns the
norm), the scheduler steps once per optimizer step, ``DummyOptim`` / ``DummyScheduler`` become the
config's AdamW and schedule, and ``bf16`` / ``fp16`` become the model's ``MixedPrecision``.
Without DeepSpeed, accelerate's own semantics hold, its ``mixed_precision`` autocasting included.

``z3hf.prepare(accelerator, model, ...)`` and ``z3hf.accumulate(accelerator, model)`` are the
same for a plain ``accelerate.Accelerator``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import accelerate
import torch
import torch.nn as nn
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DeepSpeedPlugin,
    convert_outputs_to_fp32,
    get_mixed_precision_context_manager,
)

# accelerate.utils exports these only when deepspeed is installed; their module does not need it
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch.distributed.tensor import DTensor

from .._torch.dynamo import uncompiled
from ..compiler.options import Options
from ..frontend.accumulation import set_requires_gradient_sync
from ..frontend.mixed_precision import MixedPrecision, set_mixed_precision
from ..frontend.module import Zero3Module
from ..frontend.shard import shard
from ..io.checkpoint import load_checkpoint, save_checkpoint
from ..io.state_dict import full_state_dict
from ..offload.optim import offload_optimizer
from .deepspeed_config import LeafModules, translate
from .generation import mark_sharded

STATE_FOLDER = "zero3_state"  # in a save_state folder: model i's shards in zero3_state[_i]


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for zero3-sharded models (see the module docstring).

    Every argument is accelerate's, plus:

    zero3_options: ``torch.compile(..., backend="zero3", options=...)`` (``z3.Options``); they
        override the environment's ``ZERO3_OPTIONS`` (JSON, for a launcher: the script stays
        as it is), which override what a DeepSpeed config sets.
    compile: False leaves the sharded model uncompiled (eager gathers: slower, for debugging).

    Example:
        ```python
        from zero3_compile.hf import Accelerator     # was: from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.save_state("checkpoint")          # every rank: sharded
        ```
    """

    def __init__(
        self,
        *args,
        zero3_options: dict[str, Any] | None = None,
        compile: bool = True,
        deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
        deepspeed_plugins: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
        **kwargs,
    ):
        plugin = _one_plugin(deepspeed_plugin, deepspeed_plugins)
        if kwargs.get("cpu") is None and _distributed_without_accelerator():
            # accelerate runs the processes torchrun started one by one on CPUs unless told cpu=True
            kwargs["cpu"] = True
        translated = None
        if plugin is not None:
            mixed = kwargs.get("mixed_precision") or os.environ.get(
                "ACCELERATE_MIXED_PRECISION", "no"
            )
            plugin.set_mixed_precision(str(mixed))  # as accelerate does: bf16/fp16 "enabled"
            translated = translate(plugin.deepspeed_config)
            _moe_leaves(plugin, translated)
            steps = translated.args.get("gradient_accumulation_steps")
            if steps is not None:  # DeepSpeed's value wins, as under accelerate + DeepSpeed
                kwargs["gradient_accumulation_steps"] = steps
            # the model casts (MixedPrecision) or autocasts itself; "fp16" keeps the loss scaling
            kwargs["mixed_precision"] = "fp16" if translated.args.get("fp16") else "no"
        with _deepspeed_hidden():  # accelerate would start a DeepSpeed engine otherwise
            super().__init__(*args, **kwargs)
        self._zero3 = translated
        self._zero3_plugin = plugin
        self._zero3_options = {
            **(translated.options if translated else {}),
            **_options_from_environment(),
            **(zero3_options or {}),
        }
        Options.from_dict(self._zero3_options)  # unknown or bad options fail here, not later
        self._zero3_compile = compile
        self._zero3_bases: dict[int, nn.Module] = {}  # id(compiled) -> the sharded model
        self._zero3_clip_hooked: set[int] = set()
        self._zero3_moved: dict[int, _Moved] = {}  # id(unsharded parameter) -> its shard
        if plugin is not None:
            self.deepspeed_config = plugin.deepspeed_config
            _expose_plugin(self.state, plugin)
            if translated.args.get("fp16"):
                # accelerate makes a GradScaler on accelerators only; fp16 gradients need one
                self.scaler = torch.amp.GradScaler(self.device.type, **translated.scaler)
                self.native_amp = True

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args, device_placement=None):
        """accelerate's ``prepare``: models sharded and compiled, optimizers moved onto the shards,
        ``DummyOptim`` / ``DummyScheduler`` built from the DeepSpeed config."""
        names = _parameter_names(args)
        result = super().prepare(*args, device_placement=device_placement)
        result = list(result) if len(args) > 1 else [result]
        self._remember_moved(names, result)
        for obj in result:
            inner = getattr(obj, "optimizer", obj)
            if isinstance(inner, torch.optim.Optimizer):
                _point_at(inner, self._zero3_moved)
        self._check_deepspeed_objects(result)
        built: dict[int, Any] = {}  # id(DummyOptim) -> the optimizer made for it
        for i, obj in enumerate(result):
            if isinstance(obj, DummyOptim):
                optimizer = self._zero3.optimizer.build(
                    _remapped(obj.params, self._zero3_moved), lr=obj.lr,
                    weight_decay=obj.weight_decay,
                )  # fmt: skip
                result[i] = built[id(obj)] = self.prepare_optimizer(optimizer)
        for i, obj in enumerate(result):
            if isinstance(obj, DummyScheduler):
                result[i] = self.prepare_scheduler(self._scheduler_for(obj, built))
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode=False):
        """Shard ``model`` (unless it is) and compile it with the zero3 backend."""
        if id(model) in self._zero3_bases:
            return model
        base = uncompiled(model)
        policy = self._zero3_policy()
        if not isinstance(base, Zero3Module):
            shard_kwargs = dict(self._zero3.shard) if self._zero3 else {}
            if policy is not None:
                shard_kwargs["mp_policy"] = policy
            base = shard(base.to(self.device), **shard_kwargs)
        elif policy is not None and base.zero3_runtime.policy != policy:
            set_mixed_precision(base, policy)
        if self._zero3 is not None:
            self._zero3.set_leaf_modules(base)
        mark_sharded(base)
        self._autocast(base)
        compiled = (
            torch.compile(base, backend="zero3", options=self._zero3_options)
            if self._zero3_compile
            else base
        )
        self._zero3_bases[id(compiled)] = base
        self._models.append(compiled)
        return compiled

    def prepare_optimizer(self, optimizer, device_placement=None):
        if self._zero3 is not None and self._zero3.optimizer_offload is not None:
            if not getattr(optimizer, "_zero3_tiled", False):
                optimizer = offload_optimizer(optimizer, **self._zero3.optimizer_offload)
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._zero3_plugin is not None:
            self._clip_at_step(prepared.optimizer)
        return prepared

    def prepare_scheduler(self, scheduler):
        """DeepSpeed steps its scheduler once per optimizer step; accelerate alone steps it once
        per process (its batches are per-process)."""
        if self._zero3_plugin is None or getattr(scheduler, "_is_accelerate_prepared", False):
            return super().prepare_scheduler(scheduler)
        optimizers = [o for o in self._optimizers if o.optimizer is scheduler.optimizer]
        prepared = AcceleratedScheduler(
            scheduler,
            optimizers[0] if optimizers else self._optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=True,
        )
        self._schedulers.append(prepared)
        return prepared

    # ------------------------------------------------------------------ training

    @contextlib.contextmanager
    def no_sync(self, model):
        """No gradient reduce-scatter in this context: gradients accumulate unreduced."""
        base = self._zero3_bases.get(id(model)) or _sharded_base(model)
        if base is None:
            with super().no_sync(model):
                yield
            return
        set_requires_gradient_sync(base, False)
        try:
            yield
        finally:
            set_requires_gradient_sync(base, True)  # reduced in the next backward

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """accelerate's; under a DeepSpeed config, as DeepSpeed: the config's
        ``gradient_clipping`` clips at the optimizer step, this returns the norm."""
        if self._zero3_plugin is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return _clip(list(parameters), None, norm_type)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """accelerate's; for a model prepared here, the user's model (the zero3 compile is ours,
        not the script's)."""
        base = self._zero3_bases.get(id(model))
        return super().unwrap_model(
            model if base is None else base,
            keep_fp32_wrapper=keep_fp32_wrapper,
            keep_torch_compile=keep_torch_compile,
        )

    # ------------------------------------------------------------------ state

    def get_state_dict(self, model, unwrap=True):
        """The full weights (every rank must call it: it gathers)."""
        base = self._zero3_bases.get(id(model)) or _sharded_base(model)
        if base is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return full_state_dict(base)

    def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):
        """accelerate's files (schedulers, RNG, scaler, samplers, step, custom objects) and each
        zero3 model's shards with its optimizer's (``zero3_state/``)."""
        pairs = self._zero3_pairs()
        with self._without(pairs):
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        for i, (base, optimizer) in enumerate(pairs):
            save_checkpoint(_state_path(location, i), base, optimizer)
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Load what ``save_state`` wrote: training resumes bit for bit."""
        input_dir = self._checkpoint_dir(input_dir)
        pairs = self._zero3_pairs()
        with self._without(pairs):
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        for i, (base, optimizer) in enumerate(pairs):
            load_checkpoint(_state_path(input_dir, i), base, optimizer)

    # ------------------------------------------------------------------ internals

    def _zero3_policy(self) -> MixedPrecision | None:
        args = self._zero3.args if self._zero3 is not None else {}
        if self._zero3 is None or self._zero3.autocast is not None:
            return None
        if args.get("bf16"):
            return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.get("fp16"):
            return MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        return None

    def _autocast(self, model: nn.Module) -> None:
        """Autocast the forward: accelerate's ``mixed_precision`` as accelerate does it, or a
        DeepSpeed config's ``torch_autocast``."""
        if self._zero3 is not None and self._zero3.autocast is not None:
            context = torch.autocast(self.device.type, dtype=self._zero3.autocast)
        elif self._zero3 is None and self.native_amp:
            context = get_mixed_precision_context_manager(self.native_amp, self.autocast_handler)
        else:
            return
        model._original_forward = model.forward
        model.forward = convert_outputs_to_fp32(context(model.forward))

    def _remember_moved(self, names: dict[int, tuple], result: list) -> None:
        """Record, for each parameter of a model prepared here, the shard that replaced it (an
        optimizer prepared later, in another call, is moved onto the shards too)."""
        for old_id, (ref, position, name) in names.items():
            base = self._zero3_bases.get(id(result[position]))
            param = ref()
            if base is None or param is None:
                continue
            new = dict(base.named_parameters(remove_duplicate=False)).get(name)
            if new is not None and new is not param:
                self._zero3_moved[old_id] = _Moved(ref, new)

    def _check_deepspeed_objects(self, result: list) -> None:
        """accelerate's rules for a DeepSpeed config's optimizer and scheduler sections."""
        config = self._zero3_plugin.deepspeed_config if self._zero3_plugin else {}
        for obj in result:
            if isinstance(obj, DummyOptim) and self._zero3 is None:
                raise ValueError("zero3: DummyOptim needs a DeepSpeed config with an optimizer")
            if isinstance(obj, DummyOptim) and "optimizer" not in config:
                raise ValueError(
                    "zero3: a DummyOptim needs an optimizer section in the DeepSpeed config "
                    "(accelerate refuses it too); pass a torch optimizer instead"
                )
            inner = getattr(obj, "optimizer", None)
            if "optimizer" in config and isinstance(inner, torch.optim.Optimizer):
                if not isinstance(obj, (DummyScheduler, AcceleratedScheduler)):
                    raise ValueError(
                        "zero3: the DeepSpeed config has an optimizer section and the script "
                        "passes its own optimizer (accelerate refuses both too); pass "
                        "accelerate.utils.DummyOptim, or remove the section"
                    )
            scheduler = getattr(obj, "scheduler", None)
            if "scheduler" in config and scheduler is not None:
                raise ValueError(
                    "zero3: the DeepSpeed config has a scheduler section and the script passes "
                    "its own scheduler (accelerate refuses both too); pass "
                    "accelerate.utils.DummyScheduler, or remove the section"
                )
            if (
                isinstance(obj, DummyScheduler)
                and obj.lr_scheduler_callable is None
                and "scheduler" not in config
            ):
                raise ValueError(
                    "zero3: a DummyScheduler needs a scheduler section in the DeepSpeed config "
                    "or an lr_scheduler_callable (accelerate refuses it too)"
                )

    def _scheduler_for(self, dummy: DummyScheduler, built: dict[int, Any]):
        prepared = built.get(id(dummy.optimizer))
        optimizer = prepared.optimizer if prepared is not None else dummy.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if dummy.lr_scheduler_callable is not None:
            return dummy.lr_scheduler_callable(optimizer)
        total = dummy.total_num_steps
        if total is not None and not self.split_batches:  # as accelerate fills it for DeepSpeed
            total = math.ceil(total / self.num_processes)
        warmup = max(1, dummy.warmup_num_steps)
        return self._zero3.lr_schedule.build(optimizer, total_steps=total, warmup_steps=warmup)

    def _clip_at_step(self, optimizer: torch.optim.Optimizer) -> None:
        """DeepSpeed's engine clips by the config's gradient_clipping before each step."""
        max_norm = (self._zero3.args if self._zero3 else {}).get("max_grad_norm")
        if not max_norm or id(optimizer) in self._zero3_clip_hooked:
            return
        self._zero3_clip_hooked.add(id(optimizer))

        def clip(opt, args, kwargs):
            params = [p for group in opt.param_groups for p in group["params"]]
            _clip(params, max_norm, 2)

        optimizer.register_step_pre_hook(clip)

    def _zero3_pairs(self) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
        """Each zero3 model with the optimizer of its parameters."""
        pairs = []
        for compiled in self._models:
            base = self._zero3_bases.get(id(compiled))
            if base is None:
                continue
            own = {id(p) for p in base.parameters()}
            optimizers = [
                o.optimizer
                for o in self._optimizers
                if any(id(p) in own for g in o.optimizer.param_groups for p in g["params"])
            ]
            if len(optimizers) > 1:
                raise ValueError(
                    "zero3: save_state/load_state: a model's parameters are in several "
                    "optimizers; use one optimizer per model"
                )
            pairs.append((base, optimizers[0] if optimizers else None))
        return pairs

    @contextlib.contextmanager
    def _without(self, pairs) -> Iterator[None]:
        """accelerate's save/load without the zero3 models and their optimizers."""
        models, optimizers = self._models, self._optimizers
        ours = {id(opt) for _, opt in pairs}
        self._models = [m for m in models if id(m) not in self._zero3_bases]
        self._optimizers = [o for o in optimizers if id(o.optimizer) not in ours]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def _checkpoint_dir(self, input_dir) -> str:
        """The folder accelerate's ``load_state`` reads (the latest automatic one if None)."""
        if input_dir is not None:
            return os.path.expanduser(input_dir)
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"(\d+)$", f)[0]))
        return os.path.join(root, folders[-1])


def _moe_leaves(plugin: DeepSpeedPlugin, translated) -> None:
    """``accelerate launch --deepspeed_moe_layer_cls_names``: leaf modules, by class name."""
    names = plugin.transformer_moe_cls_names or os.environ.get(
        "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"
    )
    if names:
        leaves = translated.leaf_modules or LeafModules()
        leaves.classes = [*leaves.classes, *names.split(",")]
        translated.leaf_modules = leaves


def _options_from_environment() -> dict[str, Any]:
    text = os.environ.get("ZERO3_OPTIONS")
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"zero3: ZERO3_OPTIONS is not JSON ({error}): {text!r}") from error
    if not isinstance(options, dict):
        raise ValueError('zero3: ZERO3_OPTIONS must be a JSON object ({"codegen": "eager"})')
    return options


def _distributed_without_accelerator() -> bool:
    """Started as one of several processes (torchrun, accelerate launch) on a machine without
    GPUs: zero3 shards over gloo there."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > 1 and not torch.cuda.is_available()


def _one_plugin(plugin, plugins) -> DeepSpeedPlugin | None:
    """The DeepSpeed plugin given, or the one ``accelerate launch --use_deepspeed`` describes in
    the environment (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_*``)."""
    if plugin is not None and plugins is not None:
        raise ValueError("You cannot pass in both `deepspeed_plugins` and `deepspeed_plugin`.")
    plugin = plugin if plugin is not None else plugins
    if isinstance(plugin, dict):
        if len(plugin) != 1:
            raise ValueError(
                "zero3: several DeepSpeed plugins (one per model) are not supported; give one"
            )
        plugin = next(iter(plugin.values()))
    if plugin is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        plugin = DeepSpeedPlugin()
    if plugin is not None and not isinstance(plugin, DeepSpeedPlugin):
        raise TypeError("`deepspeed_plugin` must be a DeepSpeedPlugin object.")
    return plugin


@contextlib.contextmanager
def _deepspeed_hidden() -> Iterator[None]:
    before = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = before


class _ZeroState(AcceleratorState):
    """This accelerator's state: ``state.deepspeed_plugin`` is the plugin the script gave or
    launched with (scripts choose ``DummyOptim`` by it), though no DeepSpeed engine runs."""

    @property
    def deepspeed_plugin(self):
        return self.__dict__.get("_zero3_plugin")


def _expose_plugin(state: AcceleratorState, plugin: DeepSpeedPlugin) -> None:
    state._zero3_plugin = plugin
    state.__class__ = _ZeroState


class _Moved(NamedTuple):
    old: weakref.ref  # the unsharded parameter (its id alone could be reused once it is freed)
    new: nn.Parameter


def _shard_of(param, moved: dict[int, _Moved]):
    entry = moved.get(id(param))
    return entry.new if entry is not None and entry.old() is param else param


def _parameter_names(args) -> dict[int, tuple]:
    """id(parameter) -> (a weak reference to it, its model's position in ``args``, its name)."""
    names: dict[int, tuple] = {}
    for position, model in enumerate(args):
        if not isinstance(model, nn.Module):
            continue
        base = uncompiled(model)
        for name, param in base.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), (weakref.ref(param), position, name))
    return names


def _point_at(optimizer: torch.optim.Optimizer, moved: dict[int, _Moved]) -> None:
    """An optimizer built before ``prepare`` takes the shards in place of the parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(_shard_of(p, moved) is p for p in params):
        return
    if any(optimizer.state.get(p) for p in params):
        raise ValueError(
            "zero3: the optimizer already holds state for the unsharded parameters; prepare it "
            "before its first step"
        )
    for group in optimizer.param_groups:
        group["params"] = [_shard_of(p, moved) for p in group["params"]]
    optimizer.state.clear()


def _remapped(params, moved: dict[int, _Moved]):
    """DummyOptim's parameters (tensors or groups) on the shards."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": [_shard_of(p, moved) for p in g["params"]]} for g in params]
    return [_shard_of(p, moved) for p in params]


def _sharded_base(model) -> nn.Module | None:
    base = uncompiled(model)
    return base if isinstance(base, Zero3Module) else None


def _state_path(folder: str, index: int) -> str:
    return os.path.join(folder, STATE_FOLDER if index == 0 else f"{STATE_FOLDER}_{index}")


def _clip(parameters: list, max_norm: float | None, norm_type: float) -> torch.Tensor:
    """The gradients' total norm over every rank's shards; scaled down to ``max_norm``."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    by_kind: dict[Any, list] = {}
    for grad in grads:
        by_kind.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = [torch.nn.utils.get_total_norm(group, norm_type) for group in by_kind.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


# ---------------------------------------------------------------------- a plain Accelerator


def prepare(accelerator, model: nn.Module, *objects, zero3_options: dict[str, Any] | None = None,
            compile: bool = True):  # fmt: skip
    """``(compiled model, *accelerator.prepare(objects))`` for a plain ``accelerate.Accelerator``;
    shards ``model`` first if needed. (``Accelerator`` above does this inside ``prepare``.)

    Example:
        ```python
        accelerator = accelerate.Accelerator()
        model, opt, loader = z3hf.prepare(accelerator, model, opt, loader)  # model sharded, compiled
        ```
    """
    if str(getattr(accelerator, "mixed_precision", "no")) not in ("no", "None"):
        raise ValueError(
            f"zero3: Accelerator(mixed_precision={accelerator.mixed_precision!r}) would autocast "
            "around the sharded model; leave it 'no' and give the model a z3.MixedPrecision "
            "(z3hf.from_pretrained(..., mp_policy=z3.MixedPrecision(torch.bfloat16, "
            "torch.float32))), or use zero3_compile.hf.Accelerator, which autocasts as accelerate"
        )
    if not isinstance(model, Zero3Module):
        model = shard(model.to(accelerator.device))
    mark_sharded(model)
    compiled = (
        torch.compile(model, backend="zero3", options=zero3_options or {}) if compile else model
    )
    prepared = accelerator.prepare(*objects) if objects else ()
    if len(objects) == 1:
        prepared = (prepared,)
    return (compiled, *prepared)


@contextlib.contextmanager
def accumulate(accelerator, model: nn.Module) -> Iterator[None]:
    """``accelerator.accumulate(model)`` for a zero3 model and a plain ``accelerate.Accelerator``:
    gradients are reduce-scattered only on the micro-batch where accelerate syncs (its own
    ``no_sync`` does nothing for a model it did not wrap).

    Example:
        ```python
        for batch in loader:
            with z3hf.accumulate(accelerator, model):  # instead of accelerator.accumulate(model)
                accelerator.backward(model(**batch).loss)
                opt.step()
                opt.zero_grad()
        ```
    """
    base = uncompiled(model)
    with accelerator.accumulate(base):
        sync = bool(accelerator.sync_gradients)
        set_requires_gradient_sync(base, sync)
        yield
