"""``translate_deepspeed_config`` against DeepSpeed 0.19.8 itself: every field and alias of its
ZeRO-3 config models has an entry; the ZeRO-3 configs DeepSpeed's own unit tests train with
(``tests/unit/runtime/zero``, ``tests/unit/v1/zero``, ``tests/unit/v1/compile``; rewritten here)
are accepted by DeepSpeed's parser and by ours, with what each becomes; refusals say why; the
learning-rate schedules equal DeepSpeed's classes step by step; notes are logged once, on rank 0.
Pure Python: no process group."""

from __future__ import annotations

import logging

import pytest
import torch

from zero3_compile.hf import deepspeed_config as ds_config
from zero3_compile.hf import translate_deepspeed_config as translate
from zero3_compile.hf.deepspeed_keys import KEYS, NOTED, REFUSED, SECTIONS, TRANSLATED


def _deepspeed():
    return pytest.importorskip("deepspeed.runtime.config")


def _zero(**zero):
    return {"zero_optimization": {"stage": 3, **zero}}


# ------------------------------------------------------------------ every key DeepSpeed reads


def test_every_field_and_alias_of_deepspeeds_config_models_has_an_entry():
    _deepspeed()
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    models = {
        "zero_optimization": DeepSpeedZeroConfig,
        "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
        "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
        "zero_optimization.leaf_module": DeepSpeedZeroLeafModuleConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
    }
    missing = []
    for section, model in models.items():
        for name, info in model.model_fields.items():
            for key in (name, info.alias):
                if key and key not in SECTIONS[section]:
                    missing.append(f"{section}.{key}")
    assert not missing, missing
    # and the keys DeepSpeed 0.19.8 refuses as removed
    from deepspeed.runtime import config as runtime

    assert set(runtime._REMOVED_TOP_LEVEL_CONFIG_KEYS) <= set(SECTIONS[""])
    assert set(runtime._REMOVED_ZERO_CONFIG_KEYS) <= set(SECTIONS["zero_optimization"])
    assert all(what.split(":")[0] in (TRANSLATED, NOTED, REFUSED) for what in KEYS.values())


@pytest.mark.parametrize("section", ["zero_optimization", "zero_optimization.offload_param",
                                     "zero_optimization.offload_optimizer", "fp16", "bf16"])  # fmt: skip
def test_each_key_at_its_deepspeed_default_is_accepted(section):
    """Every field set to DeepSpeed's own default value: accepted (none of the refused keys is on
    by default)."""
    _deepspeed()
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    model = {
        "zero_optimization": DeepSpeedZeroConfig,
        "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
        "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
    }[section]
    for name, info in model.model_fields.items():
        if info.default_factory is not None or name in ("stage", "offload_param", "zenflow"):
            continue
        default = info.default.value if hasattr(info.default, "value") else info.default
        if section == "zero_optimization":
            config = _zero(**{name: default})
        elif section.startswith("zero_optimization."):
            config = _zero(**{section.split(".")[1]: {name: default}})
        else:
            config = {**_zero(), section: {name: default}}
        translate(config, on_gpu=False)


# ------------------------------------------------------------------ DeepSpeed's test configs

# ZeRO-3 configs of DeepSpeed's unit tests (the facts: keys and values they train with)
DEEPSPEED_TEST_CONFIGS = {
    "plain": _zero(),
    "persistence-0-subgroups": _zero(stage3_param_persistence_threshold=0, sub_group_size=4),
    "nvme-both": _zero(
        offload_param={"device": "nvme", "nvme_path": "/local_nvme"},
        offload_optimizer={"device": "nvme", "nvme_path": "/local_nvme"},
        sub_group_size=100,
        stage3_max_live_parameters=100,
        stage3_param_persistence_threshold=0,
    ),  # fmt: skip
    "cpu-params-pinned": _zero(
        stage3_param_persistence_threshold=1, offload_param={"device": "cpu", "pin_memory": True}
    ),
    "allreduce-fetch": _zero(stage3_use_all_reduce_for_fetch_params=True),
    "granularity": _zero(
        stage3_param_persistence_threshold=0,
        stage3_module_granularity_threshold=0,
        stage3_use_all_reduce_for_fetch_params=False,
    ),  # fmt: skip
    "sanity-checks": _zero(enable_sanity_checks=True),
    "optimizer-cpu-no-overlap": _zero(
        offload_optimizer={"device": "cpu"}, contiguous_gradients=True, overlap_comm=False
    ),
    "prefetch-no-reuse": _zero(
        stage3_prefetch_bucket_size=16 * 16,
        stage3_param_persistence_threshold=0,
        stage3_max_reuse_distance=0,
    ),  # fmt: skip
    "no-prefetch": _zero(
        stage3_max_reuse_distance=0,
        stage3_param_persistence_threshold=8,
        contiguous_gradients=False,
        stage3_prefetch_bucket_size=0,
        reduce_scatter=False,
    ),  # fmt: skip
    "memory-efficient-linear": _zero(
        memory_efficient_linear=False,
        stage3_param_persistence_threshold=0,
        stage3_max_reuse_distance=0,
    ),  # fmt: skip
    "partial-offload": _zero(
        sub_group_size=8,
        reduce_bucket_size=20,
        offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 0.3},
    ),  # fmt: skip
    "zero++": _zero(
        stage3_max_reuse_distance=0,
        zero_hpz_partition_size=2,
        zero_quantized_weights=True,
        zero_quantized_gradients=True,
        contiguous_gradients=True,
        overlap_comm=True,
    ),  # fmt: skip
    "hpz-persistence": _zero(zero_hpz_partition_size=2, stage3_param_persistence_threshold=1),
    "old-cpu-offload": _zero(cpu_offload=True),
    "old-cpu-offload-param": _zero(cpu_offload_param=True),
    "old-fp16-save-name": _zero(stage3_gather_fp16_weights_on_model_save=True),
    "pipeline-loading": _zero(pipeline_loading_checkpoint=True),
    "leaf-modules": _zero(
        leaf_module={"classes": ["MoEBlock"], "names": ["blocks.0"], "name_suffixes": "experts"}
    ),
    "unprefixed": _zero(
        prefetch_bucket_size=1000,
        param_persistence_threshold=10,
        max_live_parameters=500,
        max_reuse_distance=5,
        model_persistence_threshold=100,
        module_granularity_threshold=4,
        use_all_reduce_for_fetch_params=True,
        allgather_sequential=True,
        gather_16bit_weights_on_model_save=True,
    ),  # fmt: skip
    "everything-else": _zero(
        log_trace_cache_warnings=True,
        override_module_apply=False,
        save_muon_momentum_buffer_in_memory=True,
        use_multi_rank_bucket_allreduce=False,
        parameter_alignment=True,
        round_robin_gradients=True,
        legacy_stage1=False,
        load_from_fp32_weights=False,
        elastic_checkpoint=False,
        ignore_unused_parameters=False,
        allgather_partitions=True,
        allgather_bucket_size=100,
        cpu_offload_use_pin_memory=True,
        compute_grad_norm=True,
        zero_quantized_nontrainable_weights=False,
    ),  # fmt: skip
    "autocast": {
        **_zero(),
        "torch_autocast": {
            "enabled": True,
            "dtype": "torch.bfloat16",
            "lower_precision_safe_modules": ["torch.nn.Linear"],
        },
    },  # fmt: skip
    "deepcompile": {**_zero(), "compile": {"deepcompile": True}, "gradient_clipping": 1.0},
    "fp16-adam": {
        **_zero(),
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    },
    "bf16-warmup": {
        **_zero(),
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
        },
        "gradient_allreduce_op": "mean",
        "prescale_gradients": False,
        "checkpoint": {"load_universal": False, "tag_validation": "Warn"},
    },
    "monitoring": {
        **_zero(),
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "tensorboard": {"enabled": False},
        "flops_profiler": {"enabled": False},
        "comms_logger": {"enabled": False},
        "activation_checkpointing": {"partition_activations": False},
        "aio": {"block_size": 1048576, "queue_depth": 8},
        "tensor_parallel": {"autotp_size": 1},
        "sequence_parallel_size": 1,
    },
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_TEST_CONFIGS))
def test_deepspeeds_own_test_configs_are_accepted_by_deepspeed_and_here(name):
    _deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    config = {"train_micro_batch_size_per_gpu": 1, **DEEPSPEED_TEST_CONFIGS[name]}
    DeepSpeedConfig(dict(config))  # DeepSpeed's parser takes it (a world of 1)
    out = translate(config, on_gpu=True)
    assert isinstance(out.notes, list)


def test_what_deepspeeds_test_configs_become():
    configs = DEEPSPEED_TEST_CONFIGS
    out = translate(configs["nvme-both"], on_gpu=False)
    assert out.shard["offload"].params == "disk" and out.shard["offload"].path == "/local_nvme"
    assert out.optimizer_offload == {"tier": "disk", "path": "/local_nvme", "tile_mb": 1.0}
    assert out.options == {"max_inflight_bytes": 400, "prefetch_depth": 8}
    # the deprecated booleans are offload sections with device cpu (on an accelerator)
    assert translate(configs["old-cpu-offload"], on_gpu=True).optimizer_offload == {"tier": "cpu"}
    param = translate(configs["old-cpu-offload-param"], on_gpu=True).shard["offload"]
    assert param.params == "cpu"
    assert "offload_param.device=cpu" in " ".join(
        translate(configs["old-cpu-offload-param"], on_gpu=False).notes
    )
    # prefetch 0 turns prefetching off; un-prefixed names are the same keys as stage3_*
    assert translate(configs["no-prefetch"]).options == {"prefetch_depth": 0}
    unprefixed = translate(configs["unprefixed"]).options
    assert unprefixed == {"max_inflight_bytes": 2000, "prefetch_depth": 8}
    assert translate(_zero(stage3_max_live_parameters=500, stage3_prefetch_bucket_size=1000)
                     ).options == unprefixed  # fmt: skip
    assert translate(configs["zero++"]).options == {
        "secondary_shard": 2, "weight_quantization": "int8", "gradient_quantization": "int4"
    }  # fmt: skip
    assert translate(configs["partial-offload"], on_gpu=True).optimizer_offload["tier"] == "cpu"
    assert translate(configs["partial-offload"]).options == {"bucket_mb": 80 / 2**20}
    autocast = translate(configs["autocast"])
    assert autocast.autocast is torch.bfloat16 and autocast.args == {"bf16": True}
    fp16 = translate(configs["fp16-adam"])
    assert fp16.args == {"fp16": True, "learning_rate": 1e-3} and fp16.scaler == {
        "init_scale": 256.0
    }
    warm = translate(configs["bf16-warmup"])
    assert warm.args == {"bf16": True} and warm.lr_schedule.kind == "WarmupLR"
    # bf16 gathers are 2-byte: the prefetch cap in bytes halves
    bf16 = translate({**_zero(stage3_prefetch_bucket_size=100), "bf16": {"enabled": True}})
    assert bf16.options["max_inflight_bytes"] == 200
    assert translate(configs["deepcompile"]).args == {"max_grad_norm": 1.0}


def test_a_hugging_face_style_config_is_translated():
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 2**20,
            "stage3_prefetch_bucket_size": 2**21,
            "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 10,
    }
    out = translate(config, on_gpu=False)
    # bucket: 2**20 fp32 reduction elements; prefetch: 2**21 bf16 gathered elements
    assert out.options == {"bucket_mb": 4.0, "max_inflight_bytes": 2**22, "prefetch_depth": 8}
    assert out.shard["offload"].params == "disk" and out.shard["offload"].path == "/nvme"
    assert out.optimizer_offload == {"tier": "disk", "path": "/nvme"}
    assert out.args == {
        "bf16": True,
        "learning_rate": 2e-4,
        "weight_decay": 0.1,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "max_grad_norm": 0.5,
    }
    assert out.lr_schedule.kind == "WarmupDecayLR"  # rebuilt exactly by the trainer
    assert any("stage3_param_persistence_threshold" in note for note in out.notes)
    fp16 = translate(
        {
            **_zero(),
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "hysteresis": 2,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
            },
        }
    )
    assert fp16.args == {"fp16": True}
    assert fp16.scaler == {"init_scale": 4096.0, "growth_interval": 500}
    assert any("hysteresis" in note for note in fp16.notes)


def test_noted_keys_say_why():
    notes = translate(DEEPSPEED_TEST_CONFIGS["unprefixed"]).notes
    keys = {note.split(":")[0] for note in notes}
    assert {"zero_optimization.param_persistence_threshold",
            "zero_optimization.max_reuse_distance",
            "zero_optimization.model_persistence_threshold",
            "zero_optimization.module_granularity_threshold",
            "zero_optimization.gather_16bit_weights_on_model_save"} <= keys  # fmt: skip
    assert all(len(note.split(": ", 1)[1]) > 10 for note in notes)
    mics = translate(_zero(mics_shard_size=2)).notes
    assert any("mics_shard_size=2" in note and "mesh" in note for note in mics)
    assert not any("mics" in note for note in translate(_zero(mics_shard_size=-1)).notes)
    unknown = translate({**_zero(), "my_own_key": 1}).notes
    assert unknown == ["my_own_key: not a key DeepSpeed 0.19.8 reads; ignored, as DeepSpeed does"]


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": 2}}, "stage is 2"),
        (_zero(sparse_gradients=True), "sparse_gradients"),  # not a ZeRO key (DeepSpeed refuses)
        ({**_zero(), "sparse_gradients": True}, "removed in DeepSpeed 0.19"),
        ({**_zero(), "amp": {}}, "amp"),
        (_zero(zeropp_loco_param={"err_beta": 0.8}), "removed"),
        (_zero(zenflow={}), "ZenFlow"),
        (_zero(compute_grad_norm=False), "compute_grad_norm"),
        (_zero(zero_quantized_nontrainable_weights=True), "frozen weights"),
        (_zero(prefetch_bucket_size=1, stage3_prefetch_bucket_size=2), "alias"),
        (_zero(cpu_offload=True, offload_optimizer={"device": "cpu"}), "cpu_offload"),
        (_zero(offload_param={"device": "gpu"}), "must be cpu, nvme or none"),
        (_zero(offload_optimizer={"device": "cpu", "speed": 2}), "speed"),
        (_zero(leaf_module={"types": ["X"]}), "types"),
        ({**_zero(), "gradient_allreduce_op": "sum"}, "averaged"),
        ({**_zero(), "weight_quantization": {"quantized_initialization": {}}}, "quantizes"),
        ({**_zero(), "data_types": {"buffer_dtype": "bf16"}}, "buffers"),
        ({**_zero(), "data_types": {"param_dtype": "bf16"}}, "param_dtype"),
        ({**_zero(), "tensor_parallel": {"autotp_size": 2}}, "DTensor mesh"),
        ({**_zero(), "sequence_parallel_size": 2}, "sequence parallelism"),
        ({**_zero(), "expert_parallel": {"enabled": True}}, "expert parallelism"),
        ({**_zero(), "data_efficiency": {"enabled": True}}, "samples"),
        ({**_zero(), "fp16": {"enabled": True, "loss_scale": 128}}, "static loss scale"),
        ({**_zero(), "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "choose one"),
        ({**_zero(), "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "fp32"),
        ({**_zero(), "bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}, "choose"),
        ({**_zero(), "torch_autocast": {"enabled": True, "dtype": "int8"}}, "bfloat16 or"),
        (_zero(zero_hpz_partition_size="8"), "zero_hpz"),
        ({**_zero(), "optimizer": {"type": "Lamb"}}, "optim=..."),
        ({**_zero(), "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "L2"),
        ({**_zero(), "optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "amsgrad"),
        ({**_zero(), "scheduler": {"type": "OneCycle"}}, "OneCycle"),
        ({**_zero(), "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}}, "log"),
    ],
)
def test_keys_that_would_change_the_results_are_refused_with_the_reason(config, message):
    with pytest.raises(ValueError, match=message):
        translate(config, on_gpu=False)


# ------------------------------------------------------------------ what each part becomes


def test_leaf_modules_resolve_by_class_name_dotted_name_module_name_and_suffix():
    class MoEBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    model = torch.nn.Sequential(MoEBlock(), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    spec = translate(DEEPSPEED_TEST_CONFIGS["leaf-modules"]).leaf_modules
    found = spec.resolve(model)
    assert found == [model[0], model[0].experts]  # the class, and the name ending "experts"
    dotted = ds_config.LeafModules(classes=["torch.nn.modules.linear.Linear"], names=["2"])
    assert dotted.resolve(model) == [model[0].experts[0], model[1], model[2]]


@pytest.mark.parametrize(
    "kind,params",
    [
        ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 7}),
        ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
        ("WarmupDecayLR", {"warmup_num_steps": 4, "total_num_steps": 20, "warmup_max_lr": 0.02}),
        ("WarmupDecayLR", {"warmup_num_steps": 1, "total_num_steps": 9, "warmup_type": "linear"}),
        ("WarmupCosineLR", {"warmup_num_steps": 6, "total_num_steps": 25}),
        (
            "WarmupCosineLR",
            {
                "warmup_num_steps": 3,
                "total_num_steps": 12,
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.05,
                "warmup_type": "linear",
            },
        ),  # fmt: skip
    ],
)
def test_schedules_equal_deepspeeds_step_by_step(kind, params):
    """Against DeepSpeed's own classes, 30 steps (past the end of the decay)."""
    _deepspeed()
    from deepspeed.runtime import lr_schedules

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)

    theirs_opt, ours_opt = optimizer(), optimizer()
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    spec = ds_config.ScheduleSpec.parse({"type": kind, "params": params})
    ours = spec.build(ours_opt, total_steps=None, warmup_steps=None)
    for _ in range(30):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(
            theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15
        )
        theirs.step()
        ours.step()
    state = ours.state_dict()
    again = spec.build(optimizer(), total_steps=None, warmup_steps=None)
    again.load_state_dict(state)
    assert again.last_epoch == ours.last_epoch


def test_auto_schedule_values_come_from_the_trainer():
    spec = ds_config.ScheduleSpec.parse({
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                   "warmup_num_steps": "auto", "total_num_steps": "auto"},
    })  # fmt: skip
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    schedule = spec.build(opt, total_steps=10, warmup_steps=2)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        schedule.step()
    # DeepSpeed's log warmup over max(2, 2) steps from 0 to the optimizer's lr, then a linear
    # decay reaching 0 at step 10 (the values after 0, 1, 2, ... steps)
    assert lrs[:4] == [0.0, 0.0, 0.5, 0.5]
    assert lrs[4] == pytest.approx(0.5 * 7 / 8) and lrs[11] == 0.0
    with pytest.raises(ValueError, match="total_num_steps"):
        spec.build(opt, total_steps=None, warmup_steps=None)


def test_a_dummy_optimizer_becomes_deepspeeds_adamw():
    spec = ds_config.OptimizerSpec.parse(
        {"type": "Adam", "params": {"lr": "auto", "betas": [0.8, 0.95], "eps": 1e-6}}
    )
    opt = spec.build([torch.nn.Parameter(torch.zeros(2))], lr=0.02, weight_decay=0.1)
    assert isinstance(opt, torch.optim.AdamW)  # DeepSpeed's Adam is AdamW (adam_w_mode)
    defaults = {k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    assert defaults == {"lr": 0.02, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def test_notes_are_logged_once_on_rank_0(caplog, monkeypatch):
    config = _zero(stage3_max_reuse_distance=7, overlap_comm=True)
    monkeypatch.setattr(ds_config, "_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger=ds_config.logger.name):
        translate(config)
        translate(config)
    records = [r for r in caplog.records if r.name == ds_config.logger.name]
    assert len(records) == 1
    assert "stage3_max_reuse_distance" in records[0].getMessage()
    monkeypatch.setattr(ds_config, "_LOGGED", set())
    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ds_config.logger.name):
        translate(config)
    assert not [r for r in caplog.records if r.name == ds_config.logger.name]
