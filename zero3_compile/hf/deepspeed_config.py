"""A DeepSpeed ZeRO-3 configuration (file or dict) translated into zero3_compile's settings.

``z3hf.Trainer(..., zero3_config="ds_config.json")`` or ``z3hf.Accelerator()`` under
``accelerate launch --use_deepspeed``: a DeepSpeed user changes one word. Every key and alias
that DeepSpeed 0.19.8 reads for ZeRO stage 3 has an entry in ``KEYS`` (the docs' table is made
from it): translated where zero3_compile has a counterpart; accepted with a logged note where it
only tunes how DeepSpeed works inside; refused, with the reason, only where ignoring it would
change what training computes (as DeepSpeed itself refuses the keys it removed). Sizes
DeepSpeed gives in elements become bytes of the dtype communicated.

```python
out = translate_deepspeed_config("ds_config.json")
out.options        # torch.compile(model, backend="zero3", options=out.options)
out.shard          # z3.shard(model, **out.shard)
out.notes          # what was accepted without a counterpart (logged once, on rank 0)
```
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..frontend.leaves import set_leaf_modules
from ..offload.model import Offload
from .deepspeed_keys import HOST_MEMORY, KEYS, NOTED, REFUSED, REMOVED, SECTIONS, TOP
from .deepspeed_schedules import OptimizerSpec, ScheduleSpec

__all__ = ["KEYS", "LeafModules", "Translated", "translate"]

logger = logging.getLogger(__name__)
MiB = 2**20

# ------------------------------------------------------------------ the result


@dataclass
class LeafModules:
    """DeepSpeed's ``leaf_module`` section: modules gathered whole when called."""

    classes: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    name_suffixes: list[str] = field(default_factory=list)

    def resolve(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``model`` that match, in ``named_modules()`` order."""
        found = []
        for name, module in model.named_modules():
            cls = type(module)
            dotted = f"{cls.__module__}.{cls.__qualname__}"
            if (
                cls.__name__ in self.classes
                or dotted in self.classes
                or name in self.names
                or any(name.endswith(s) for s in self.name_suffixes)
            ):
                found.append(module)
        return found


@dataclass
class Translated:
    """What a DeepSpeed config becomes (``translate``)."""

    options: dict[str, Any] = field(default_factory=dict)  # torch.compile(..., options=)
    shard: dict[str, Any] = field(default_factory=dict)  # z3.shard keyword arguments
    optimizer_offload: dict[str, Any] | None = None  # z3.offload_optimizer keyword arguments
    args: dict[str, Any] = field(default_factory=dict)  # TrainingArguments fields to set
    scaler: dict[str, Any] = field(default_factory=dict)  # torch.amp.GradScaler arguments (fp16)
    leaf_modules: LeafModules | None = None  # z3.set_leaf_modules, resolved on the model
    optimizer: OptimizerSpec | None = None  # the config's Adam/AdamW (for DummyOptim)
    lr_schedule: ScheduleSpec | None = None  # the config's schedule, exact
    autocast: torch.dtype | None = None  # torch_autocast's dtype
    notes: list[str] = field(default_factory=list)

    def set_leaf_modules(self, model: nn.Module) -> list[nn.Module]:
        """Apply the config's ``leaf_module`` section to a sharded ``model``."""
        if self.leaf_modules is None:
            return []
        modules = self.leaf_modules.resolve(model)
        return set_leaf_modules(model, modules) if modules else []


# ------------------------------------------------------------------ translation


def translate(
    config: str | os.PathLike | dict, args=None, *, on_gpu: bool | None = None
) -> Translated:
    """Translate a DeepSpeed config (a path to JSON or a dict) checked against ``args``
    (``TrainingArguments``, for the ``"auto"`` and consistency rules).

    The notes (keys accepted without a counterpart) are logged once, on rank 0, and kept in
    ``Translated.notes``.

    Example:
        >>> out = translate({"zero_optimization": {"stage": 3, "overlap_comm": True}})
        >>> out.notes
        ['zero_optimization.overlap_comm: communication overlaps compute as the compiler schedules it']
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(
            f"zero3: zero3_config must be a path or a dict, got {type(config).__name__}"
        )
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    out = Translated()
    _check_section("", config, out, unknown_is_error=False)
    zero = config.get("zero_optimization")
    half = _precision(config, out)
    _zero(zero, out, on_gpu, gather_bytes=2 if half else 4)
    _batch(config, args, out)
    _top_values(config, out)
    if config.get("optimizer") is not None:
        out.optimizer = OptimizerSpec.parse(config["optimizer"])
        _optimizer_args(out.optimizer, out)
    if config.get("scheduler") is not None:
        out.lr_schedule = ScheduleSpec.parse(config["scheduler"])
    clip = config.get("gradient_clipping", "auto")
    if clip not in ("auto", None):
        out.args["max_grad_norm"] = float(clip)
    _log_notes(out.notes)
    return out


def _check_section(prefix: str, section: dict, out: Translated, unknown_is_error: bool) -> None:
    """Refuse the refused keys that are on and unknown keys (DeepSpeed's config models forbid
    them); note the noted ones."""
    rules = SECTIONS[prefix]
    where = f"{prefix}." if prefix else ""
    unknown = sorted(set(section) - set(rules))
    if unknown and unknown_is_error:
        raise ValueError(
            f"zero3: DeepSpeed config keys {[where + k for k in unknown]} are not DeepSpeed "
            f"0.19.8's (it refuses them too); known here: {', '.join(sorted(rules))}"
        )
    for key in unknown:  # top level: DeepSpeed ignores keys it does not read, and so do we
        out.notes.append(f"{key}: not a key DeepSpeed 0.19.8 reads; ignored, as DeepSpeed does")
    for key in sorted(set(section) & set(rules)):
        action, text = rules[key]
        if action == REFUSED and (text == REMOVED or _on(section[key])):
            raise ValueError(f"zero3: DeepSpeed config key {where}{key}: {text}")
        if action == NOTED:
            out.notes.append(f"{where}{key}: {text}")


def _on(value) -> bool:
    """Whether a key is on: a section unless it says ``enabled: false``; a value unless false,
    0 or none. (A refused key set off is harmless.)"""
    if isinstance(value, dict):
        return value.get("enabled", True) not in (False, "false")
    return value not in (None, False, 0, "none", "auto")


def _alias(zero: dict, name: str, alias: str, default=None):
    if name in zero and alias in zero:
        raise ValueError(
            f"zero3: zero_optimization has both {name!r} and its alias {alias!r}; keep one"
        )
    value = zero.get(name, zero.get(alias, default))
    return default if value == "auto" else value


def _zero(zero, out: Translated, on_gpu: bool, gather_bytes: int) -> None:
    if not isinstance(zero, dict):
        raise ValueError(
            "zero3: the DeepSpeed config has no zero_optimization section (a dict with stage 3)"
        )
    if zero.get("stage") != 3:
        raise ValueError(
            f"zero3: zero_optimization.stage is {zero.get('stage')!r}; zero3_compile is ZeRO stage 3"
        )
    _check_section("zero_optimization", zero, out, unknown_is_error=True)
    if zero.get("compute_grad_norm", True) is False:
        raise ValueError(
            "zero3: zero_optimization.compute_grad_norm=false is a stage 1/2 setting (DeepSpeed "
            "refuses it at stage 3); remove it"
        )
    mics = zero.get("mics_shard_size", -1)
    if mics not in (-1, None, "auto"):
        out.notes.append(
            f"zero_optimization.mics_shard_size={mics}: zero3 shards over all ranks (the same "
            "results); z3.shard(mesh=...) shards within groups of ranks and replicates across them"
        )
    _zero_plus_plus(zero, out)
    bucket = zero.get("reduce_bucket_size", "auto")
    if bucket != "auto":
        out.options["bucket_mb"] = max(int(float(bucket)) * 4 / MiB, 1 / MiB)
    prefetch = _alias(zero, "prefetch_bucket_size", "stage3_prefetch_bucket_size")
    live = _alias(zero, "max_live_parameters", "stage3_max_live_parameters")
    if prefetch is not None and int(float(prefetch)) == 0:
        out.options["prefetch_depth"] = 0  # DeepSpeed: no prefetch
    else:
        caps = [int(float(c)) * gather_bytes for c in (prefetch, live) if c is not None]
        if caps:
            out.options["max_inflight_bytes"] = max(min(caps), 1)
            out.options["prefetch_depth"] = 8  # as far ahead as the byte cap allows
    _offload(zero, out, on_gpu)
    if zero.get("leaf_module") is not None:
        out.leaf_modules = _leaf_modules(zero["leaf_module"], out)


def _zero_plus_plus(zero: dict, out: Translated) -> None:
    hpz = zero.get("zero_hpz_partition_size", 1)
    if not (isinstance(hpz, int) and not isinstance(hpz, bool) and hpz >= 0):
        raise ValueError(
            f"zero3: zero_optimization.zero_hpz_partition_size must be a count of ranks, got {hpz!r}"
        )
    if hpz > 1:
        out.options["secondary_shard"] = hpz
    if zero.get("zero_quantized_weights"):
        out.options["weight_quantization"] = "int8"
    if zero.get("zero_quantized_gradients"):
        out.options["gradient_quantization"] = "int4"  # DeepSpeed's qgZ sends int4


def _offload(zero: dict, out: Translated, on_gpu: bool) -> None:
    param = _offload_section(zero, "offload_param", "cpu_offload_param", out)
    device = param.get("device", "none")
    if device == "nvme":
        out.shard["offload"] = Offload(params="disk", path=_path(param.get("nvme_path")))
    elif device == "cpu":
        if on_gpu:
            out.shard["offload"] = Offload(params="cpu")
        else:
            out.notes.append(f"zero_optimization.offload_param.device=cpu: {HOST_MEMORY}")
    optim = _offload_section(zero, "offload_optimizer", "cpu_offload", out)
    device = optim.get("device", "none")
    if device == "nvme":
        out.optimizer_offload = {"tier": "disk", "path": _path(optim.get("nvme_path"))}
    elif device == "cpu":
        if on_gpu:
            out.optimizer_offload = {"tier": "cpu"}
        else:
            out.notes.append(f"zero_optimization.offload_optimizer.device=cpu: {HOST_MEMORY}")
    if out.optimizer_offload is not None and zero.get("sub_group_size", "auto") != "auto":
        out.optimizer_offload["tile_mb"] = max(int(float(zero["sub_group_size"])) * 4 / MiB, 1.0)


def _offload_section(zero: dict, key: str, old_key: str, out: Translated) -> dict:
    section = zero.get(key)
    if zero.get(old_key) and section is not None:
        raise ValueError(
            f"zero3: zero_optimization has both {old_key!r} and {key!r} (DeepSpeed refuses that "
            "too); keep the second"
        )
    if zero.get(old_key):  # the deprecated boolean: {device: cpu}
        section = {"device": "cpu"}
    section = section or {}
    if not isinstance(section, dict):
        raise ValueError(f"zero3: zero_optimization.{key} must be a dict, got {section!r}")
    _check_section(f"zero_optimization.{key}", section, out, unknown_is_error=True)
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme", None):
        raise ValueError(
            f"zero3: zero_optimization.{key}.device={device!r} must be cpu, nvme or none"
        )
    return section


def _path(path) -> str | None:
    return None if path in (None, "none", "auto") else os.fspath(path)


def _leaf_modules(section, out: Translated) -> LeafModules:
    if not isinstance(section, dict):
        raise ValueError(f"zero3: zero_optimization.leaf_module must be a dict, got {section!r}")
    _check_section("zero_optimization.leaf_module", section, out, unknown_is_error=True)
    lists = {}
    for key in ("classes", "names", "name_suffixes"):
        value = section.get(key, [])
        lists[key] = [value] if isinstance(value, str) else [str(v) for v in value]
    return LeafModules(**lists)


def _precision(config: dict, out: Translated) -> bool:
    """bf16 / fp16 / torch_autocast; returns whether the gathers are 2-byte."""
    if "bf16" in config and "bfloat16" in config:
        raise ValueError('zero3: the DeepSpeed config has both "bf16" and "bfloat16"; keep "bf16"')
    bf16_section = config.get("bf16", config.get("bfloat16")) or {}
    fp16_section = config.get("fp16") or {}
    _check_section("bf16", bf16_section, out, unknown_is_error=True)
    _check_section("fp16", fp16_section, out, unknown_is_error=True)
    bf16 = bf16_section.get("enabled", False) is True
    fp16 = fp16_section.get("enabled", False) is True
    if fp16 and bf16:
        raise ValueError('zero3: the DeepSpeed config enables both "fp16" and "bf16": choose one')
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if bf16_section.get(key):
            raise ValueError(
                f"zero3: bf16.{key}: master shards, gradients and optimizer state stay fp32 here "
                "(a bf16 copy would change the updates); remove the key"
            )
    if bf16:
        out.args["bf16"] = True
    if fp16:
        _fp16(fp16_section, out)
    autocast = _autocast(config.get("torch_autocast"), out)
    if autocast is not None:
        if bf16 or fp16:
            raise ValueError(
                'zero3: the DeepSpeed config enables "torch_autocast" and "bf16"/"fp16": choose one'
            )
        out.autocast = autocast
        out.args["bf16" if autocast == torch.bfloat16 else "fp16"] = True
        out.notes.append(
            "torch_autocast: z3hf.Accelerator autocasts the forward as DeepSpeed does; "
            "z3hf.Trainer casts the whole model instead (MixedPrecision), which rounds differently"
        )
    _data_types(config.get("data_types"), out, bf16=bf16, fp16=fp16)
    return bf16 or fp16


def _fp16(section: dict, out: Translated) -> None:
    """fp16 with dynamic loss scaling: torch's GradScaler with DeepSpeed's initial scale and
    growth window (it halves on the first overflow; DeepSpeed's hysteresis waits for a few)."""
    if section.get("loss_scale", 0) not in (0, 0.0, "auto"):
        raise ValueError(
            f"zero3: fp16.loss_scale={section['loss_scale']} (a static loss scale) is not "
            "supported; use 0 for dynamic loss scaling"
        )
    if section.get("fp16_master_weights_and_grads"):
        raise ValueError(
            "zero3: fp16.fp16_master_weights_and_grads is not supported: master shards and "
            "gradients stay fp32 (remove the key)"
        )
    out.args["fp16"] = True
    power = section.get("initial_scale_power", "auto")
    if power != "auto":
        out.scaler["init_scale"] = 2.0 ** int(power)
    window = section.get("loss_scale_window", "auto")
    if window != "auto":
        out.scaler["growth_interval"] = int(window)


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "torch.float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
           "float": torch.float32, "torch.float32": torch.float32}  # fmt: skip


def _autocast(section, out: Translated) -> torch.dtype | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"zero3: torch_autocast must be a dict, got {section!r}")
    _check_section("torch_autocast", section, out, unknown_is_error=False)
    if section.get("enabled", False) is not True:
        return None  # DeepSpeed reads only "enabled" (a misspelt "enable" leaves it off there too)
    dtype = _DTYPES.get(str(section.get("dtype", "bf16")))
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"zero3: torch_autocast.dtype={section.get('dtype')!r} must be bfloat16 or float16"
        )
    return dtype


def _data_types(section, out: Translated, *, bf16: bool, fp16: bool) -> None:
    if section is None:
        return
    _check_section("data_types", section, out, unknown_is_error=False)
    wanted = section.get("param_dtype")
    if wanted is not None:
        model = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
        if _DTYPES.get(str(wanted)) != model:
            raise ValueError(
                f"zero3: data_types.param_dtype={wanted!r} disagrees with the bf16/fp16 sections "
                "(DeepSpeed asserts they agree); fix one of them"
            )


def _top_values(config: dict, out: Translated) -> None:
    """The top-level keys accepted at some values only."""
    op = str(config.get("gradient_allreduce_op", "mean")).lower()
    if op != "mean":
        raise ValueError(
            f"zero3: gradient_allreduce_op={op!r}: gradients are averaged over ranks (DeepSpeed "
            "also refuses 'sum' at stage 3); use 'mean'"
        )
    tp = config.get("tensor_parallel") or {}
    size = max(int(tp.get("autotp_size", 0) or 0), int((tp.get("tp") or {}).get("tp_size", 1)))
    if size > 1:
        raise ValueError(
            f"zero3: tensor_parallel size {size}: tensor parallelism is a DTensor mesh here "
            "(see docs/guides/parallel-3d.md); remove the section"
        )
    if (config.get("expert_parallel") or {}).get("enabled"):
        raise ValueError(
            "zero3: expert_parallel: no expert parallelism here (experts are sharded like every "
            "parameter, and leaf modules gather them together); remove the section"
        )
    if int(config.get("sequence_parallel_size", 1)) > 1:
        raise ValueError(
            "zero3: sequence_parallel_size > 1: no sequence parallelism here; remove the key"
        )
    data = config.get("data_efficiency") or {}
    if data.get("enabled"):
        raise ValueError(
            "zero3: data_efficiency.enabled: DeepSpeed's data sampling and routing change which "
            "samples train; remove it (or turn it off)"
        )
    notes = {
        "gradient_allreduce_op": TOP["gradient_allreduce_op"][1],
        "tensor_parallel": "size 1: " + TOP["tensor_parallel"][1],
        "expert_parallel": "disabled",
        "sequence_parallel_size": "1",
        "data_efficiency": "disabled",
    }
    for key, text in notes.items():
        if key in config:
            out.notes.append(f"{key}: {text}")


def _batch(config: dict, args, out: Translated) -> None:
    for key, field_name in (
        ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ):
        value = config.get(key, "auto")
        if value == "auto":
            continue
        if args is not None and getattr(args, field_name) != int(value):
            raise ValueError(
                f"zero3: the DeepSpeed config says {key}={value} but TrainingArguments."
                f'{field_name}={getattr(args, field_name)}; make them agree (or write "auto")'
            )
        out.args[field_name] = int(value)
    total = config.get("train_batch_size", "auto")
    if total != "auto" and args is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        expected = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        if int(total) != expected:
            raise ValueError(
                f"zero3: train_batch_size={total} but micro batch x accumulation x world = "
                f'{expected}; make them agree (or write "auto")'
            )


def _optimizer_args(spec: OptimizerSpec, out: Translated) -> None:
    """The Trainer's AdamW settings (TrainingArguments' default optimizer is AdamW)."""
    params = spec.params
    for key, field_name in (("lr", "learning_rate"), ("eps", "adam_epsilon"),
                            ("weight_decay", "weight_decay")):  # fmt: skip
        if params.get(key, "auto") != "auto":
            out.args[field_name] = float(params[key])
    betas = params.get("betas", "auto")
    if betas != "auto":
        out.args["adam_beta1"], out.args["adam_beta2"] = (float(b) for b in betas)


_LOGGED: set[tuple[str, ...]] = set()


def _log_notes(notes: list[str]) -> None:
    """One warning with every note, on rank 0, once per distinct set of notes in a process."""
    key = tuple(notes)
    if not notes or key in _LOGGED:
        return
    _LOGGED.add(key)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.warning(
            "zero3: DeepSpeed config keys accepted without a counterpart:\n  %s",
            "\n  ".join(notes),
        )
