"""A DeepSpeed ZeRO-3 configuration (file or dict) translated into zero3_compile's settings.

``z3hf.Trainer(..., zero3_config="ds_config.json")``: a DeepSpeed user changes one word. Keys with
a meaning here are translated; keys that describe how DeepSpeed itself works (and that
zero3_compile does by construction) are accepted with a note; anything else is an error that
lists the keys understood. Sizes DeepSpeed gives in elements become bytes of the communicated
dtype.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..offload.params import Offload

MiB = 2**20

# keys whose job zero3_compile does by construction: accepted, with the reason
_BY_CONSTRUCTION = {
    "overlap_comm": "communication always overlaps compute (scheduled in the graphs)",
    "contiguous_gradients": "gradients are bucketed into flat buffers by the compiler",
    "reduce_scatter": "gradients are always reduce-scattered",
    "round_robin_gradients": "not needed: each rank owns its rows of every parameter",
    "stage3_max_reuse_distance": "a gathered parameter is freed right after its last use",
    "stage3_param_persistence_threshold": (
        "small parameters share their block's bucket instead of being kept whole"
    ),
    "model_persistence_threshold": "small parameters share their block's bucket",
    "stage3_gather_16bit_weights_on_model_save": "save_model always writes the full weights",
    "stage3_gather_fp16_weights_on_model_save": "save_model always writes the full weights",
    "gather_16bit_weights_on_model_save": "save_model always writes the full weights",
    "ignore_unused_parameters": "parameters no rank used keep grad=None, as in eager",
    "load_from_fp32_weights": "checkpoints hold the fp32 shards",
    "elastic_checkpoint": "checkpoints load at any world size",
    "memory_efficient_linear": "not needed",
    "allgather_partitions": "parameters are always all-gathered from their shards",
    "allgather_bucket_size": "stage 1/2 setting; stage 3 uses reduce_bucket_size",
    "sub_group_size": "offloaded optimizer state streams in tiles (offload_optimizer tile_mb)",
}
_TOP_NOTES = {
    "steps_per_print": "logging follows TrainingArguments.logging_steps",
    "wall_clock_breakdown": "use z3.explain / TORCH_LOGS for timings",
    "zero_allow_untested_optimizer": "any torch.optim optimizer works",
    "communication_data_type": "set reduce_dtype with bf16/MixedPrecision",
    "prescale_gradients": "gradients are averaged after the reduction",
    "gradient_predivide_factor": "gradients are averaged after the reduction",
    "activation_checkpointing": "use TrainingArguments(gradient_checkpointing=True)",
    "flops_profiler": "not translated",
    "tensorboard": "use TrainingArguments(report_to=...)",
    "wandb": "use TrainingArguments(report_to=...)",
    "csv_monitor": "use TrainingArguments(report_to=...)",
    "comms_logger": "use z3.explain for the collectives",
    "dump_state": "not translated",
}
# ZeRO++: hpZ's partition size (ranks per node), qwZ, qgZ (DeepSpeed's qgZ sends int4)
_ZERO_PLUS_PLUS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
_UNSUPPORTED = {
    "mics_shard_size": "MiCS is not supported; use a hybrid mesh (z3.shard(mesh=...))",
}
_ZERO_KEYS = {"stage", "reduce_bucket_size", "stage3_prefetch_bucket_size",
              "stage3_max_live_parameters", "offload_param", "offload_optimizer",
              *_ZERO_PLUS_PLUS, *_BY_CONSTRUCTION, *_UNSUPPORTED}  # fmt: skip
_TOP_KEYS = {"zero_optimization", "bf16", "fp16", "gradient_clipping", "train_batch_size",
             "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
             "scheduler", *_TOP_NOTES}  # fmt: skip
_SCHEDULERS = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear",
               "WarmupCosineLR": "cosine"}  # fmt: skip


@dataclass
class Translated:
    options: dict[str, Any] = field(default_factory=dict)  # torch.compile(..., options=)
    shard: dict[str, Any] = field(default_factory=dict)  # z3.shard keyword arguments
    optimizer_offload: dict[str, Any] | None = None  # z3.offload_optimizer keyword arguments
    args: dict[str, Any] = field(default_factory=dict)  # TrainingArguments fields to set
    scaler: dict[str, Any] = field(default_factory=dict)  # torch.amp.GradScaler arguments (fp16)
    notes: list[str] = field(default_factory=list)


def translate(
    config: str | os.PathLike | dict, args=None, *, on_gpu: bool | None = None
) -> Translated:
    """Translate a DeepSpeed config (a path to JSON or a dict) checked against ``args``
    (``TrainingArguments``, for the ``"auto"`` and consistency rules)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(
            f"zero3: zero3_config must be a path or a dict, got {type(config).__name__}"
        )
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    out = Translated()
    unknown = sorted(set(config) - _TOP_KEYS)
    if unknown:
        raise ValueError(
            f"zero3: DeepSpeed config keys {unknown} have no meaning for zero3_compile; understood: "
            f"{', '.join(sorted(_TOP_KEYS))}"
        )
    for key in sorted(set(config) & set(_TOP_NOTES)):
        out.notes.append(f"{key}: {_TOP_NOTES[key]}")
    _zero(config.get("zero_optimization"), out, on_gpu)
    _precision(config, out)
    _batch(config, args, out)
    _optimizer(config.get("optimizer"), out)
    _scheduler(config.get("scheduler"), out)
    clip = config.get("gradient_clipping", "auto")
    if clip != "auto":
        out.args["max_grad_norm"] = float(clip)
    return out


def _zero(zero: dict | None, out: Translated, on_gpu: bool) -> None:
    if not isinstance(zero, dict):
        raise ValueError("zero3: the DeepSpeed config has no zero_optimization section")
    if zero.get("stage") != 3:
        raise ValueError(
            f"zero3: zero_optimization.stage is {zero.get('stage')!r}; zero3_compile is ZeRO stage 3"
        )
    unknown = sorted(set(zero) - _ZERO_KEYS)
    if unknown:
        raise ValueError(
            f"zero3: zero_optimization keys {unknown} are not understood; understood: "
            f"{', '.join(sorted(_ZERO_KEYS))}"
        )
    for key, why in _UNSUPPORTED.items():
        if zero.get(key) not in (None, False, 0, 1):
            raise ValueError(f"zero3: zero_optimization.{key}: {why}")
    hpz = zero.get("zero_hpz_partition_size", 1)
    if not (isinstance(hpz, int) and not isinstance(hpz, bool) and hpz >= 1):
        raise ValueError(
            f"zero3: zero_optimization.zero_hpz_partition_size must be a count of ranks >= 1, "
            f"got {hpz!r}"
        )
    if hpz > 1:
        out.options["secondary_shard"] = hpz
    if zero.get("zero_quantized_weights"):
        out.options["weight_quantization"] = "int8"
    if zero.get("zero_quantized_gradients"):
        out.options["gradient_quantization"] = "int4"
    for key in sorted(set(zero) & set(_BY_CONSTRUCTION)):
        out.notes.append(f"zero_optimization.{key}: {_BY_CONSTRUCTION[key]}")
    bucket = zero.get("reduce_bucket_size", "auto")
    if bucket != "auto":
        out.options["bucket_mb"] = max(int(float(bucket)) * 4 / MiB, 1 / MiB)
    caps = [
        zero.get(k, "auto") for k in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters")
    ]
    caps = [int(float(c)) * 4 for c in caps if c != "auto"]
    if caps:
        out.options["max_inflight_bytes"] = max(min(caps), 1)
        out.options["prefetch_depth"] = 8  # as far ahead as the byte cap allows
    param = zero.get("offload_param") or {}
    device = param.get("device", "none")
    if device == "nvme":
        out.shard["offload"] = Offload(params="disk", path=param.get("nvme_path"))
    elif device == "cpu":
        if on_gpu:
            out.shard["offload"] = Offload(params="cpu")
        else:
            out.notes.append("offload_param.device=cpu: the model already lives in host memory")
    elif device not in ("none", None):
        raise ValueError(f"zero3: offload_param.device={device!r} must be cpu, nvme or none")
    optim = zero.get("offload_optimizer") or {}
    device = optim.get("device", "none")
    tile_mb = None
    if zero.get("sub_group_size", "auto") != "auto":
        tile_mb = max(int(float(zero["sub_group_size"])) * 4 / MiB, 1.0)
    if device == "nvme":
        out.optimizer_offload = {"tier": "disk", "path": optim.get("nvme_path")}
    elif device == "cpu":
        if on_gpu:
            out.optimizer_offload = {"tier": "cpu"}
        else:
            out.notes.append("offload_optimizer.device=cpu: the state already lives in host memory")
    elif device not in ("none", None):
        raise ValueError(f"zero3: offload_optimizer.device={device!r} must be cpu, nvme or none")
    if out.optimizer_offload is not None and tile_mb is not None:
        out.optimizer_offload["tile_mb"] = tile_mb


def _precision(config: dict, out: Translated) -> None:
    bf16 = (config.get("bf16") or {}).get("enabled", False)
    fp16_config = config.get("fp16") or {}
    fp16 = fp16_config.get("enabled", False)
    if fp16 is True and bf16 is True:
        raise ValueError('zero3: the DeepSpeed config enables both "fp16" and "bf16": choose one')
    if bf16 is True:
        out.args["bf16"] = True
    if fp16 is True:
        _fp16(fp16_config, out)


_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}  # fmt: skip


def _fp16(section: dict, out: Translated) -> None:
    """fp16 with dynamic loss scaling: torch's GradScaler with DeepSpeed's initial scale and
    growth window (it halves on the first overflow; DeepSpeed's hysteresis waits for a few)."""
    unknown = sorted(set(section) - _FP16_KEYS)
    if unknown:
        raise ValueError(
            f"zero3: DeepSpeed fp16 keys {unknown} are not understood; known: {sorted(_FP16_KEYS)}"
        )
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
    for key in ("hysteresis", "consecutive_hysteresis", "min_loss_scale"):
        if key in section:
            out.notes.append(
                f"fp16.{key}: torch's GradScaler halves the scale on every overflow (no "
                "hysteresis, no floor)"
            )


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
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        expected = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        if int(total) != expected:
            raise ValueError(
                f"zero3: train_batch_size={total} but micro batch x accumulation x world = "
                f'{expected}; make them agree (or write "auto")'
            )


def _optimizer(optimizer: dict | None, out: Translated) -> None:
    if optimizer is None:
        return
    kind = optimizer.get("type", "")
    if kind.lower() not in ("adam", "adamw"):
        raise ValueError(
            f"zero3: optimizer type {kind!r}: only Adam/AdamW are translated (into "
            "TrainingArguments' optim); set another optimizer with TrainingArguments(optim=...)"
        )
    params = optimizer.get("params", {})
    for key, field_name in (("lr", "learning_rate"), ("eps", "adam_epsilon"),
                            ("weight_decay", "weight_decay")):  # fmt: skip
        if params.get(key, "auto") != "auto":
            out.args[field_name] = float(params[key])
    betas = params.get("betas", "auto")
    if betas != "auto":
        out.args["adam_beta1"], out.args["adam_beta2"] = (float(b) for b in betas)


def _scheduler(scheduler: dict | None, out: Translated) -> None:
    if scheduler is None:
        return
    kind = scheduler.get("type", "")
    if kind not in _SCHEDULERS:
        raise ValueError(
            f"zero3: scheduler type {kind!r} is not translated (known: {', '.join(_SCHEDULERS)}); "
            "set TrainingArguments(lr_scheduler_type=...) instead"
        )
    out.args["lr_scheduler_type"] = _SCHEDULERS[kind]
    warmup = scheduler.get("params", {}).get("warmup_num_steps", "auto")
    if warmup != "auto":
        out.args["warmup_steps"] = int(warmup)
