"""``zero3_compile.hf.Accelerator``: an accelerate script (``accelerate_example.py``) changed by one
import, run on 2 gloo ranks with the environment ``accelerate launch --use_deepspeed --zero_stage
3 --deepspeed_config_file`` sets, against the same script with plain accelerate in one process;
``save_state`` / ``load_state`` resume bit for bit; a ``DeepSpeedPlugin`` with the config's
optimizer and schedule (``DummyOptim`` / ``DummyScheduler``)."""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import sys
import tempfile

import torch

from ..support.dist_utils import run_ranks

# Hugging Face's ZeRO-3 template (its DeepSpeed docs), "auto" where the trainer fills values
DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _example(zero3: bool):
    os.environ["Z3"] = "1" if zero3 else "0"
    sys.modules.pop("tests.support.accelerate_example", None)
    return importlib.import_module("tests.support.accelerate_example")


def _plain(rank, world, folder):
    out = _example(zero3=False).train(folder)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # the Trainer below makes its own accelerator
    out["trainer"] = _trainer_with_a_deepspeed_schedule(folder)
    AcceleratorState._reset_state(True)
    out["late"] = _optimizer_prepared_later()
    return out


def _optimizer_prepared_later() -> bool:
    """An optimizer made before ``prepare`` and prepared in a later call: moved onto the shards."""
    from zero3_compile.hf import Accelerator

    accelerator = Accelerator(compile=False)
    linear = torch.nn.Linear(4, 6)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    linear = accelerator.prepare(linear)
    optimizer = accelerator.prepare(optimizer)
    shards = {id(p) for p in linear.parameters()}
    return all(id(p) in shards for p in optimizer.optimizer.param_groups[0]["params"])


def _trainer_with_a_deepspeed_schedule(folder: str) -> dict:
    """z3hf.Trainer takes the config's schedule (DeepSpeed's log warmup, not transformers'
    linear one) and its leaf modules."""
    import transformers

    from zero3_compile import hf as z3hf
    from zero3_compile.sharding.state import module_state

    config = {
        "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["LlamaDecoderLayer"]}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    }  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=os.path.join(folder, "trainer"), use_cpu=True, learning_rate=0.1,
        warmup_steps=4, max_steps=10, report_to=[],
    )  # fmt: skip
    model = _example(zero3=False).tiny_llama()
    trainer = z3hf.Trainer(model=model, args=args, zero3_config=config)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    lrs = []
    for _ in range(6):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    leaves = {type(ref()).__name__ for ref in module_state(model).root.leaves}
    return {"schedule": type(trainer.lr_scheduler).__name__, "lrs": lrs, "leaves": leaves}


def _zero3(rank, world, folder, config_file):
    # what `accelerate launch --use_deepspeed --zero_stage 3 --deepspeed_config_file` exports
    os.environ.update(
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
        ACCELERATE_DEEPSPEED_CONFIG_FILE=config_file,
        ACCELERATE_MIXED_PRECISION="no",
        ACCELERATE_CONFIG_DS_FIELDS="",
        ZERO3_OPTIONS='{"codegen": "eager"}',  # the launcher's choice: the script stays as it is
    )
    example = _example(zero3=True)
    out = {"full": example.train(folder)}
    out["resumed"] = example.train(folder, resume=True)
    for key in list(os.environ):
        if key.startswith("ACCELERATE_"):
            del os.environ[key]
    out["dummies"] = _dummies()
    return out


def _dummies() -> dict:
    """The config's optimizer and schedule through DummyOptim / DummyScheduler, chosen as
    accelerate's examples choose them (by ``accelerator.state.deepspeed_plugin``)."""
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    from zero3_compile.hf import Accelerator

    config = {
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.8, 0.9], "eps": 1e-7}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    }
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    accelerator = Accelerator(deepspeed_plugin=plugin, compile=False)  # eager gathers: no compile
    plugin = accelerator.state.deepspeed_plugin
    model = _example(zero3=True).tiny_llama()
    optimizer_class = DummyOptim if "optimizer" in plugin.deepspeed_config else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=0.01, weight_decay=0.05)
    scheduler = DummyScheduler(optimizer, total_num_steps=20, warmup_num_steps=4)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ids = torch.arange(24).view(2, 12)
    lrs = []
    for _ in range(3):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    inner = optimizer.optimizer
    return {
        "optimizer": type(inner).__name__,
        "defaults": {k: inner.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")},
        "sharded": all(
            type(p).__name__ == "DTensor" for g in inner.param_groups for p in g["params"]
        ),
        "stepped": len(inner.state) > 0,
        "lrs": lrs,
    }


@functools.cache
def runs() -> tuple[dict, dict]:
    folder = tempfile.mkdtemp(prefix="zero3-accelerator-")
    config_file = os.path.join(folder, "ds_config.json")
    with open(config_file, "w") as f:
        json.dump(DS_CONFIG, f)
    plain = run_ranks(_plain, 1, os.path.join(folder, "plain"), timeout=600)[0]
    zero3 = run_ranks(_zero3, 2, os.path.join(folder, "zero3"), config_file, timeout=900)
    return plain, zero3


def test_an_accelerate_script_trains_as_with_plain_accelerate():
    """Losses, gradient norms, the schedule and the final weights of the one-process run; the
    clipping and the scheduler follow DeepSpeed's engine (the config's ``gradient_clipping``, one
    scheduler step per optimizer step), as the script had with accelerate + DeepSpeed."""
    plain, zero3 = runs()
    full = zero3[0]["full"]
    assert full["processes"] == 2 and plain["processes"] == 1
    assert len(full["losses"]) == len(plain["losses"]) == 8
    assert max(abs(a - b) for a, b in zip(full["losses"], plain["losses"])) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(full["norms"], plain["norms"])) < 1e-4
    assert max(plain["norms"]) > 1.0  # clipping mattered
    assert full["lr"] == plain["lr"]
    scale = max(v.abs().max().item() for v in plain["params"].values())
    assert sorted(full["params"]) == sorted(plain["params"])
    diff = max((full["params"][k] - plain["params"][k]).abs().max().item() for k in plain["params"])
    assert diff / scale < 1e-5, diff
    assert full["unwrapped"] == plain["unwrapped"] == "LlamaForCausalLM"
    assert torch.equal(
        zero3[1]["full"]["params"]["lm_head.weight"], full["params"]["lm_head.weight"]
    )


def test_load_state_resumes_bit_identically():
    _, zero3 = runs()
    full, resumed = zero3[0]["full"], zero3[0]["resumed"]
    assert resumed["losses"] == full["losses"][4:]  # steps 3 and 4, bit for bit
    assert resumed["norms"] == full["norms"][2:]
    assert resumed["lr"] == full["lr"]
    for key, value in full["params"].items():
        assert torch.equal(resumed["params"][key], value), key


def test_dummy_optimizer_and_scheduler_are_the_deepspeed_configs():
    """AdamW with the config's betas and eps and DummyOptim's lr and weight decay ("auto"); the
    WarmupDecayLR values DeepSpeed computes (log warmup over 4 steps, total 20 / 2 processes)."""
    _, zero3 = runs()
    dummies = zero3[0]["dummies"]
    assert dummies["optimizer"] == "AdamW" and dummies["sharded"] and dummies["stepped"]
    assert dummies["defaults"] == {
        "lr": 0.01,
        "betas": (0.8, 0.9),
        "eps": 1e-7,
        "weight_decay": 0.05,
    }
    warmup, total = 4, math.ceil(20 / 2)
    expected = [0.01 * (math.log(i + 1) / math.log(warmup)) for i in range(3)]
    assert total > warmup
    assert max(abs(a - b) for a, b in zip(dummies["lrs"], expected)) < 1e-12


def test_the_trainer_runs_a_deepspeed_configs_schedule_and_leaf_modules():
    plain, _ = runs()
    trainer = plain["trainer"]
    assert trainer["schedule"] == "DeepSpeedSchedule"
    # log warmup over 4 steps to 0.1 (transformers' linear warmup would give 0.025 after one)
    expected = [0.0, 0.0] + [0.1 * (math.log(i + 1) / math.log(4)) for i in (1, 2, 3)] + [0.1]
    assert max(abs(a - b) for a, b in zip(trainer["lrs"], expected)) < 1e-12
    assert trainer["leaves"] == {"LlamaDecoderLayer"}
    assert plain["late"]


def test_accelerate_launchs_moe_layer_names_become_leaf_modules(monkeypatch):
    """``accelerate launch --deepspeed_moe_layer_cls_names`` (no process group needed)."""
    from types import SimpleNamespace

    from zero3_compile.hf.accelerate import _moe_leaves
    from zero3_compile.hf.deepspeed_config import translate

    translated = translate({"zero_optimization": {"stage": 3, "leaf_module": {"names": ["a"]}}})
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "MixtralSparseMoeBlock,Block")
    _moe_leaves(SimpleNamespace(transformer_moe_cls_names=None), translated)
    assert translated.leaf_modules.classes == ["MixtralSparseMoeBlock", "Block"]
    assert translated.leaf_modules.names == ["a"]
