"""Every DeepSpeed 0.19.8 config key that ZeRO stage 3 reads, and what each becomes here.

One table per config section (read from DeepSpeed's config models: ``runtime/config.py``,
``runtime/zero/config.py``, ``offload_config.py``, ``precision_config.py``,
``leaf_module_config.py``, with every field name and alias): ``TRANSLATED`` keys have a
counterpart (``deepspeed_config.py`` does the translating), ``NOTED`` ones only tune DeepSpeed's
own machinery and are accepted with a logged note, ``REFUSED`` ones would change what training
computes if ignored. ``KEYS`` flattens them for the docs' table.

```python
from zero3_compile.hf.deepspeed_keys import KEYS
KEYS["zero_optimization.stage3_param_persistence_threshold"]   # 'accepted with a note: ...'
```
"""

from __future__ import annotations

TRANSLATED, NOTED, REFUSED = "translated", "accepted with a note", "refused"

# fmt: off
_SAME_AVERAGE = "gradients are averaged once, after the reduction (the same mean)"
REMOVED = "removed in DeepSpeed 0.19, which refuses it too"
_LOGS = "DeepSpeed's own logging; use TORCH_LOGS / z3.explain / your trainer's reporting"
HOST_MEMORY = "the model already lives in host memory on a machine without an accelerator"

TOP: dict[str, tuple[str, str]] = {
    "zero_optimization": (TRANSLATED, "the section below; stage must be 3"),
    "train_batch_size": (TRANSLATED, "checked: micro-batch x accumulation x world size"),
    "train_micro_batch_size_per_gpu": (TRANSLATED, "TrainingArguments.per_device_train_batch_size (the Accelerator uses your DataLoader's)"),
    "gradient_accumulation_steps": (TRANSLATED, "TrainingArguments.gradient_accumulation_steps / Accelerator(gradient_accumulation_steps=)"),
    "gradient_clipping": (TRANSLATED, "TrainingArguments.max_grad_norm; the Accelerator clips at each optimizer step, as DeepSpeed's engine does"),
    "optimizer": (TRANSLATED, "Adam/AdamW: TrainingArguments' AdamW settings; accelerate's DummyOptim becomes torch.optim.AdamW"),
    "scheduler": (TRANSLATED, "WarmupLR / WarmupDecayLR / WarmupCosineLR, rebuilt exactly (deepspeed_schedules.py)"),
    "fp16": (TRANSLATED, "fp16 compute and gathers, fp32 master weights and reductions, dynamic loss scaling"),
    "bf16": (TRANSLATED, "MixedPrecision(bf16, fp32): bf16 compute and gathers, fp32 master weights and reductions"),
    "bfloat16": (TRANSLATED, "the old name of bf16"),
    "torch_autocast": (TRANSLATED, "the Accelerator autocasts the forward to its dtype (parameters stay fp32); the Trainer trains in that dtype with MixedPrecision"),
    "communication_data_type": (NOTED, "gradients are reduced in MixedPrecision.reduce_dtype (fp32 by default: at least as precise)"),
    "seq_parallel_communication_data_type": (NOTED, "no sequence parallelism here"),
    "prescale_gradients": (NOTED, _SAME_AVERAGE),
    "gradient_predivide_factor": (NOTED, _SAME_AVERAGE),
    "gradient_allreduce_op": (TRANSLATED, "'mean' (the only value DeepSpeed allows at stage 3)"),
    "disable_allgather": (NOTED, "a stage 1/2 setting"),
    "managed_gradient_accumulation": (NOTED, "accumulation boundaries follow the trainer / accelerator.accumulate"),
    "zero_allow_untested_optimizer": (NOTED, "any torch.optim optimizer works"),
    "zero_force_ds_cpu_optimizer": (NOTED, "offloaded optimizer state is stepped by the torch optimizer itself"),
    "steps_per_print": (NOTED, _LOGS),
    "wall_clock_breakdown": (NOTED, _LOGS),
    "memory_breakdown": (NOTED, _LOGS),
    "dump_state": (NOTED, _LOGS),
    "log_level": (NOTED, _LOGS),
    "timers": (NOTED, _LOGS),
    "flops_profiler": (NOTED, _LOGS),
    "comms_logger": (NOTED, "z3.explain(model) lists every collective"),
    "tensorboard": (NOTED, "use your trainer's reporting (TrainingArguments.report_to, accelerate trackers)"),
    "wandb": (NOTED, "use your trainer's reporting (TrainingArguments.report_to, accelerate trackers)"),
    "csv_monitor": (NOTED, "use your trainer's reporting (TrainingArguments.report_to, accelerate trackers)"),
    "comet": (NOTED, "use your trainer's reporting (TrainingArguments.report_to, accelerate trackers)"),
    "autotuning": (NOTED, "DeepSpeed's autotuner; zero3 options are set by hand (z3.Options)"),
    "disable_python_gc": (NOTED, "DeepSpeed's own garbage-collection control"),
    "activation_checkpointing": (NOTED, "configures deepspeed.checkpointing only; use gradient checkpointing (model.gradient_checkpointing_enable())"),
    "checkpoint": (NOTED, "zero3 checkpoints are sealed, verified, and load at any world size"),
    "datastates_ckpt": (NOTED, "DeepSpeed's asynchronous checkpoint engine"),
    "aio": (NOTED, "DeepSpeed's NVMe engine; zero3's disk offload has its own I/O (offload_optimizer(threads=, o_direct=))"),
    "data_types": (TRANSLATED, "grad_accum_dtype / keep_in_fp32_modules noted; param_dtype checked against bf16/fp16; buffer_dtype refused"),
    "dataloader_drop_last": (NOTED, "applies to DeepSpeed's own dataloader only"),
    "compile": (NOTED, "zero3 is itself the compiler backend (DeepCompile's passes have counterparts in z3.Options)"),
    "hybrid_engine": (NOTED, "generation runs on the sharded model (z3.gathered(model) for speed)"),
    "pipeline": (NOTED, "configures DeepSpeed's PipelineModule only (see guides/parallel-3d)"),
    "tensor_parallel": (TRANSLATED, "accepted at size 1; tensor parallelism is a DTensor mesh here (guides/parallel-3d)"),
    "expert_parallel": (TRANSLATED, "accepted when disabled; experts are sharded like every parameter"),
    "sequence_parallel_size": (TRANSLATED, "accepted at 1; no sequence parallelism here"),
    "data_efficiency": (TRANSLATED, "accepted when disabled; it changes which samples train"),
    "weight_quantization": (REFUSED, "quantizes the weights themselves (results change); zero_quantized_weights quantizes only the gathers"),
    "use_data_before_expert_parallelism": (NOTED, "no expert parallelism here"),
    "vocabulary_size": (NOTED, "DeepSpeed's tensor-core alignment warning"),
}
TOP.update({key: (REFUSED, REMOVED) for key in (
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
    "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
    "progressive_layer_drop")})  # fmt: skip

_PERSIST = "DeepSpeed keeps small parameters whole; zero3 shards them too and gathers them in their block's bucket (memory and speed only)"
_STAGE12 = "a ZeRO stage 1/2 setting"
_SAVE16 = "save_model / z3hf.save_pretrained / accelerator.get_state_dict always gather the full weights"
_FETCH = "gathers are bucketed per block by the compiler (bucket_mb)"
_ZERO: dict[str, tuple[str, str]] = {
    "stage": (TRANSLATED, "must be 3"),
    "reduce_bucket_size": (TRANSLATED, "bucket_mb (elements x 4 bytes: reductions are fp32)"),
    "prefetch_bucket_size": (TRANSLATED, "max_inflight_bytes with prefetch_depth 8 (0: prefetch_depth 0)"),
    "stage3_prefetch_bucket_size": (TRANSLATED, "alias of prefetch_bucket_size"),
    "max_live_parameters": (TRANSLATED, "max_inflight_bytes (the smaller of it and prefetch_bucket_size)"),
    "stage3_max_live_parameters": (TRANSLATED, "alias of max_live_parameters"),
    "offload_param": (TRANSLATED, "z3.Offload(params='cpu' | 'disk', path=nvme_path)"),
    "offload_optimizer": (TRANSLATED, "z3.offload_optimizer(tier='cpu' | 'disk', path=nvme_path)"),
    "cpu_offload": (TRANSLATED, "the old name of offload_optimizer: {device: cpu}"),
    "cpu_offload_param": (TRANSLATED, "the old name of offload_param: {device: cpu}"),
    "cpu_offload_use_pin_memory": (NOTED, "pinned host memory is chosen by the offload tier"),
    "sub_group_size": (TRANSLATED, "offload_optimizer tile_mb (elements x 4 bytes)"),
    "zero_hpz_partition_size": (TRANSLATED, "secondary_shard (ZeRO++ hpZ)"),
    "zero_quantized_weights": (TRANSLATED, "weight_quantization='int8' (ZeRO++ qwZ)"),
    "zero_quantized_gradients": (TRANSLATED, "gradient_quantization='int4' (ZeRO++ qgZ)"),
    "zero_quantized_nontrainable_weights": (REFUSED, "stores frozen weights as int8, which changes the forward; zero3 keeps them in their dtype (remove the key)"),
    "leaf_module": (TRANSLATED, "z3.set_leaf_modules (classes by name or dotted name, module names, name suffixes)"),
    "compute_grad_norm": (TRANSLATED, "true only (DeepSpeed refuses false at stage 3)"),
    "zenflow": (REFUSED, "ZenFlow defers the update of part of the parameters, which changes the training"),
    "mics_shard_size": (TRANSLATED, "-1: off; a shard group size: noted, zero3 shards over all ranks (z3.shard(mesh=...) for hybrid sharding; same results)"),
    "mics_hierarchical_params_gather": (NOTED, "no MiCS here (see mics_shard_size)"),
    "zeropp_loco_param": (REFUSED, REMOVED),
    "contiguous_gradients": (NOTED, "gradients are bucketed into flat buffers by the compiler"),
    "reduce_scatter": (NOTED, "gradients are always reduce-scattered"),
    "use_multi_rank_bucket_allreduce": (NOTED, _STAGE12),
    "allgather_partitions": (NOTED, "parameters are always all-gathered from their shards"),
    "allgather_bucket_size": (NOTED, _STAGE12 + "; stage 3 buckets with reduce_bucket_size / bucket_mb"),
    "overlap_comm": (NOTED, "communication overlaps compute as the compiler schedules it"),
    "load_from_fp32_weights": (NOTED, "checkpoints hold the fp32 shards and always load them"),
    "elastic_checkpoint": (NOTED, "checkpoints load at any world size"),
    "param_persistence_threshold": (NOTED, _PERSIST),
    "stage3_param_persistence_threshold": (NOTED, _PERSIST),
    "model_persistence_threshold": (NOTED, _PERSIST),
    "stage3_model_persistence_threshold": (NOTED, _PERSIST),
    "max_reuse_distance": (NOTED, "a gathered parameter is freed after its last use in the graph (memory_budget_mb keeps some gathered until backward)"),
    "stage3_max_reuse_distance": (NOTED, "alias of max_reuse_distance: freed after its last use"),
    "gather_16bit_weights_on_model_save": (NOTED, _SAVE16),
    "stage3_gather_16bit_weights_on_model_save": (NOTED, _SAVE16),
    "stage3_gather_fp16_weights_on_model_save": (NOTED, _SAVE16),
    "module_granularity_threshold": (NOTED, _FETCH),
    "stage3_module_granularity_threshold": (NOTED, _FETCH),
    "use_all_reduce_for_fetch_params": (NOTED, _FETCH),
    "stage3_use_all_reduce_for_fetch_params": (NOTED, _FETCH),
    "allgather_sequential": (NOTED, _FETCH),
    "stage3_allgather_sequential": (NOTED, _FETCH),
    "ignore_unused_parameters": (NOTED, "parameters no rank used keep grad=None, as in eager"),
    "legacy_stage1": (NOTED, _STAGE12),
    "round_robin_gradients": (NOTED, _STAGE12),
    "parameter_alignment": (NOTED, _STAGE12),
    "memory_efficient_linear": (NOTED, "not needed: the compiler never saves a gathered weight for backward"),
    "pipeline_loading_checkpoint": (NOTED, "DeepSpeed pipeline checkpoint loading"),
    "override_module_apply": (NOTED, "module.apply works on the sharded model"),
    "log_trace_cache_warnings": (NOTED, "no trace cache: gathers are scheduled from the graph"),
    "enable_sanity_checks": (NOTED, "zero3 verifies every scheduled graph (Options.verify)"),
    "save_muon_momentum_buffer_in_memory": (NOTED, "DeepSpeed's Muon NVMe swapping"),
}
_PARAM_OFFLOAD: dict[str, tuple[str, str]] = {
    "device": (TRANSLATED, "cpu: Offload(params='cpu') on an accelerator (noted otherwise); nvme: Offload(params='disk'); none: off"),
    "nvme_path": (TRANSLATED, "Offload(path=)"),
    "buffer_count": (NOTED, "DeepSpeed's NVMe buffer pool (zero3 reads ahead by Options.reload_depth)"),
    "buffer_size": (NOTED, "DeepSpeed's NVMe buffer pool"),
    "max_in_cpu": (NOTED, "DeepSpeed's NVMe host cache"),
    "pin_memory": (NOTED, "pinned host memory is chosen by the offload tier"),
}
_OPTIM_OFFLOAD: dict[str, tuple[str, str]] = {
    "device": (TRANSLATED, "cpu: offload_optimizer(tier='cpu') on an accelerator (noted otherwise); nvme: tier='disk'; none: off"),
    "nvme_path": (TRANSLATED, "offload_optimizer(path=)"),
    "buffer_count": (NOTED, "DeepSpeed's NVMe buffer pool"),
    "pin_memory": (NOTED, "pinned host memory is chosen by the offload tier"),
    "pipeline_read": (NOTED, "tiles are read ahead (offload_optimizer(read_ahead=))"),
    "pipeline_write": (NOTED, "tiles are written behind the step"),
    "fast_init": (NOTED, "DeepSpeed's NVMe initialisation"),
    "ratio": (NOTED, "zero3 offloads all of the optimizer state (only where it lives differs)"),
    "super_offload": (NOTED, "DeepSpeed's Superchip CPU-Adam"),
    "cpuadam_cores_perc": (NOTED, "DeepSpeed's CPU-Adam threads"),
}
_FP16: dict[str, tuple[str, str]] = {
    "enabled": (TRANSLATED, "fp16=True: MixedPrecision(fp16, fp32) and a GradScaler"),
    "auto_cast": (NOTED, "inputs keep their dtype; the model casts its parameters"),
    "loss_scale": (TRANSLATED, "0: dynamic loss scaling; a static scale is refused (GradScaler scales dynamically)"),
    "initial_scale_power": (TRANSLATED, "GradScaler(init_scale=2**power)"),
    "loss_scale_window": (TRANSLATED, "GradScaler(growth_interval=)"),
    "hysteresis": (NOTED, "torch's GradScaler halves the scale on every overflow"),
    "consecutive_hysteresis": (NOTED, "torch's GradScaler halves the scale on every overflow"),
    "min_loss_scale": (NOTED, "torch's GradScaler has no floor"),
    "fp16_master_weights_and_grads": (TRANSLATED, "false only: master shards and gradients stay fp32"),
}
_BF16: dict[str, tuple[str, str]] = {
    "enabled": (TRANSLATED, "bf16=True: MixedPrecision(bf16, fp32)"),
    "immediate_grad_update": (NOTED, "gradients are reduced into fp32 shards as they come"),
    "check_grad_overflow": (NOTED, "bf16 steps are not skipped on inf/nan gradients here"),
    "bf16_master_weights_and_grads": (TRANSLATED, "false only: master shards and gradients stay fp32"),
    "bf16_optimizer_states": (TRANSLATED, "false only: optimizer state stays fp32"),
}
_AUTOCAST: dict[str, tuple[str, str]] = {
    "enabled": (TRANSLATED, "autocast on"),
    "dtype": (TRANSLATED, "the autocast dtype (default bfloat16)"),
    "lower_precision_safe_modules": (NOTED, "torch.autocast's own op list decides what runs in low precision; gathers stay in the parameters' dtype"),
}
_DATA_TYPES: dict[str, tuple[str, str]] = {
    "grad_accum_dtype": (NOTED, "gradients accumulate in the fp32 shards"),
    "param_dtype": (TRANSLATED, "must agree with bf16/fp16, as DeepSpeed asserts"),
    "buffer_dtype": (REFUSED, "casting buffers changes the forward; cast them yourself (model.to) and remove the key"),
    "keep_in_fp32_modules": (NOTED, "buffers are not cast here"),
}
_LEAF: dict[str, tuple[str, str]] = {
    "classes": (TRANSLATED, "module classes by name or dotted name"),
    "names": (TRANSLATED, "modules by their name in named_modules()"),
    "name_suffixes": (TRANSLATED, "modules whose name ends so"),
}
# fmt: on

SECTIONS = {
    "": TOP,
    "zero_optimization": _ZERO,
    "zero_optimization.offload_param": _PARAM_OFFLOAD,
    "zero_optimization.offload_optimizer": _OPTIM_OFFLOAD,
    "zero_optimization.leaf_module": _LEAF,
    "fp16": _FP16,
    "bf16": _BF16,
    "torch_autocast": _AUTOCAST,
    "data_types": _DATA_TYPES,
}

KEYS: dict[str, str] = {
    (f"{section}.{key}" if section else key): f"{action}: {text}"
    for section, rules in SECTIONS.items()
    for key, (action, text) in rules.items()
}
"""Every DeepSpeed config key understood, dotted (``zero_optimization.offload_param.device``):
what it becomes. The docs' table of keys is generated from it."""
