"""LoRA (peft) on zero3 (2 gloo ranks) against plain peft in one process: ``get_peft_model``
after ``z3hf.from_pretrained`` and before sharding, the frozen base never reduced and without
optimizer state, on disk with ``Offload``, adapter and merged saves that plain peft and
transformers reload, resume, best model, ``generate`` with the adapter; and the plain paths that
used to go wrong in silence (a plain ``Trainer`` or ``accelerate`` given a sharded model, a plain
``Trainer`` resuming a zero3 checkpoint), the cross-rank check naming differing shapes."""

from __future__ import annotations

import functools
import os
import tempfile
import time

import pytest
import torch

from ..support.dist_utils import run_ranks, run_scenarios
from ..support.hf_models import token_data, write

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
PROMPTS = ([5, 7, 11], [13, 17, 19, 23, 29])  # rank r generates from PROMPTS[r]
NEW_TOKENS = (4, 7)


@functools.cache
def folder() -> str:
    return tempfile.mkdtemp(prefix="zero3-peft-tests-")


@functools.cache
def checkpoint() -> str:
    return write(os.path.join(folder(), "llama"), "llama")


def _args(out: str, world: int, **overrides):
    import transformers

    settings = dict(
        output_dir=out,
        per_device_train_batch_size=4 // world,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        report_to=[],
        seed=0,
        dataloader_drop_last=True,
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _adapters(model) -> dict:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _generate(model, prompt: list[int], steps: int) -> torch.Tensor:
    ids = torch.tensor([prompt])
    return model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# ------------------------------------------------------------------------ one process, plain peft


def _plain(rank, world, path, out):
    import peft
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    trainer = transformers.Trainer(
        model=model,
        args=_args(out, world),
        train_dataset=token_data(),
        eval_dataset=token_data(4, seed=1),
    )
    trainer.train()
    model.eval()
    generated = [_generate(model, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    adapters = _adapters(model)
    merged = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return {"losses": _losses(trainer), "adapters": adapters, "generated": generated,
            "merged": merged}  # fmt: skip


@functools.cache
def plain() -> dict:
    return run_ranks(_plain, 1, checkpoint(), os.path.join(folder(), "plain"), timeout=600)[0]


# ------------------------------------------------------------------------ zero3, 2 ranks


def _reduced_names(records) -> set[str]:
    """Parameters whose gradients a backward graph reduces (reduce-scatter or its all-reduce)."""
    from zero3_compile.compiler.node_keys import PARAMS

    names = set()
    for record in records:
        if record.kind != "backward":
            continue
        for node in record.gm.graph.nodes:
            target = str(node.target)
            if "reduce_scatter" in target or "all_reduce" in target:
                names.update(node.meta.get(PARAMS, ()))
    return names


def _after(rank, world, path, out):
    """LoRA on a model sharded as it loaded; counts, saves, generation."""
    import peft
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf
    from zero3_compile.sharding.state import state_of

    torch.manual_seed(0)
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, path)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    trainer = z3hf.Trainer(
        model=model,
        args=_args(out, world),
        train_dataset=token_data(),
        eval_dataset=token_data(4, seed=1),
        zero3_options={"codegen": "eager"},
    )
    with z3.record_graphs() as records:
        trainer.train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    stepped = [n for n, p in model.named_parameters() if p in trainer.optimizer.state]
    trainer.save_model(os.path.join(out, "adapter"))
    z3hf.save_pretrained(model, os.path.join(out, "merged"), merge_adapters=True)
    model.eval()
    prompt, steps = PROMPTS[rank], NEW_TOKENS[rank]
    in_step = _generate(model, prompt, steps)  # each forward gathers; ranks kept in step
    with z3.gathered(model):
        gathered = _generate(model, prompt, steps)
    return {
        "losses": _losses(trainer),
        "adapters": _adapters(model),
        "trainable": trainable,
        "stepped": stepped,
        "reduced": _reduced_names(records),
        "all sharded": all(state_of(p) is not None for p in model.parameters()),
        "best": trainer.state.best_model_checkpoint,
        "generated": (in_step, gathered),
    }


def _before(rank, world, path, out):
    """LoRA on the whole model, sharded by the Trainer."""
    import peft
    import transformers

    from zero3_compile import hf as z3hf

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    trainer = z3hf.Trainer(
        model=model,
        args=_args(out, world, max_steps=2, save_strategy="no", eval_strategy="no",
                   load_best_model_at_end=False),
        train_dataset=token_data(),
        zero3_options={"codegen": "eager"},
    )  # fmt: skip
    trainer.train()
    return {"losses": _losses(trainer)}


def _resume(rank, world, path, out, checkpoint_dir):
    import peft
    import transformers

    from zero3_compile import hf as z3hf

    torch.manual_seed(1)  # other adapter values: the checkpoint must replace them
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, path)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    trainer = z3hf.Trainer(
        model=model,
        args=_args(out, world),
        train_dataset=token_data(),
        eval_dataset=token_data(4, seed=1),
        zero3_options={"codegen": "eager"},
    )
    trainer.train(resume_from_checkpoint=checkpoint_dir)
    return {"adapters": _adapters(model), "losses": _losses(trainer)}


def _offloaded(rank, world, path, out):
    """The frozen base on disk, the adapters in memory; two steps."""
    import peft
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf
    from zero3_compile.sharding.state import state_of

    torch.manual_seed(0)
    offload = z3.Offload(params="disk", path=os.path.join(out, "store"))
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, path, offload=offload)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    trainer = z3hf.Trainer(
        model=model,
        args=_args(out, world, max_steps=2, save_strategy="no", eval_strategy="no",
                   load_best_model_at_end=False),
        train_dataset=token_data(),
        zero3_options={"codegen": "eager"},
    )  # fmt: skip
    trainer.train()
    states = {n: state_of(p) for n, p in model.named_parameters()}
    frozen = [s for n, s in states.items() if not s.param.requires_grad]
    trainable = [s for s in states.values() if s.param.requires_grad]
    return {
        "losses": _losses(trainer),
        "base on disk": all(s.offload is not None and s.offload.evicted for s in frozen),
        "adapters in memory": all(s.offload is None for s in trainable),
    }


def _refusals(rank, world, path, out):
    """What a plain Trainer or accelerate does with a sharded model; shapes that differ."""
    import accelerate
    import torch.nn as nn
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    found = {}
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, path)
    plain = transformers.Trainer(
        model=model, args=_args(out, world, save_strategy="no", eval_strategy="no",
                                load_best_model_at_end=False), train_dataset=token_data()
    )  # fmt: skip
    try:
        plain.train()
    except TypeError as error:
        found["trainer"] = str(error)
    try:
        accelerate.Accelerator(cpu=True).prepare(model)
    except TypeError as error:
        found["accelerate"] = str(error)
    # a module assigned after shard() with another shape on each rank
    torch.manual_seed(0)
    odd = z3.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), sync_timeout_s=60)
    odd[1] = nn.Linear(4, 2 + rank)
    try:
        odd(torch.ones(1, 4))
    except z3.CollectiveMismatchError as error:
        found["shapes"] = str(error)
    return found


SCENARIOS = ["after", "before", "resume", "offload", "refusals"]


def _scenario(rank, world, name, path, root):
    out = os.path.join(root, name)
    start = time.process_time()
    if name == "resume":
        found = _resume(rank, world, path, out, os.path.join(root, "after", "checkpoint-2"))
    else:
        found = {"after": _after, "before": _before, "offload": _offloaded,
                 "refusals": _refusals}[name](rank, world, path, out)  # fmt: skip
    found["cpu_s"] = time.process_time() - start  # this rank's CPU time (the suite's budget)
    return found


@functools.cache
def zero3() -> dict:
    root = os.path.join(folder(), "zero3")
    results = run_scenarios(
        _scenario, 2, [(name, checkpoint(), root) for name in SCENARIOS], timeout=1200
    )
    return {args[0]: per_rank for args, per_rank in results.items()}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ------------------------------------------------------------------------ tests


def test_lora_after_sharding_trains_like_plain_peft():
    got, ref = zero3()["after"][0], plain()
    assert len(got["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < 1e-5
    assert _max_diff(got["adapters"], ref["adapters"]) < 1e-5
    assert got["all sharded"]


def test_lora_before_sharding_trains_like_plain_peft():
    got, ref = zero3()["before"][0], plain()
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][:2])) < 1e-5


def test_the_frozen_base_is_never_reduced_and_has_no_optimizer_state():
    got = zero3()["after"][0]
    assert got["trainable"] and all("lora_" in n for n in got["trainable"])
    assert sorted(got["stepped"]) == sorted(got["trainable"])  # optimizer state: adapters only
    assert got["reduced"], "no reduce-scatter recorded"
    # every gradient reduced is an adapter's: 2 layers x (q, v) x (A, B)
    assert all("lora_" in n for n in got["reduced"]), sorted(got["reduced"])
    assert len(got["reduced"]) == 8


def test_the_adapter_saves_as_peft_writes_it_and_reloads_equal():
    import peft
    import transformers

    zero3()
    saved = os.path.join(folder(), "zero3", "after", "adapter")
    assert os.path.isfile(os.path.join(saved, "adapter_config.json"))
    assert not os.path.exists(os.path.join(saved, "model.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint())
    reloaded = peft.PeftModel.from_pretrained(base, saved)
    values = {n: p.detach() for n, p in reloaded.named_parameters() if "lora_" in n}
    trained = zero3()["after"][0]["adapters"]
    assert _max_diff(values, trained) == 0.0


def test_the_merged_export_is_a_plain_folder_with_no_missing_keys():
    import transformers

    zero3()
    merged = os.path.join(folder(), "zero3", "after", "merged")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        merged, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert _max_diff(dict(model.state_dict()), plain()["merged"]) < 1e-5


def test_resume_and_best_model_with_lora():
    after = zero3()["after"][0]
    assert after["best"] is not None and after["best"].endswith(("checkpoint-2", "checkpoint-4"))
    resumed = zero3()["resume"][0]
    assert len(resumed["losses"]) == 4  # steps 1 and 2 from the checkpoint's log, 3 and 4 run
    assert max(abs(a - b) for a, b in zip(resumed["losses"], after["losses"])) < 1e-6
    assert _max_diff(resumed["adapters"], after["adapters"]) == 0.0


def test_generate_with_the_adapter_in_step_and_gathered():
    ref = plain()["generated"]
    for rank, got in enumerate(zero3()["after"]):
        in_step, gathered = got["generated"]
        assert torch.equal(in_step, ref[rank]), (in_step, ref[rank])
        assert torch.equal(gathered, ref[rank])
    assert ref[0].shape[1] != ref[1].shape[1]  # the ranks ran other numbers of steps


def test_the_frozen_base_stays_on_disk_with_offload():
    got, ref = zero3()["offload"][0], zero3()["after"][0]
    assert got["base on disk"] and got["adapters in memory"]
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][:2])) < 1e-5


def test_a_plain_trainer_or_accelerate_refuses_a_sharded_model():
    for found in zero3()["refusals"]:
        for key in ("trainer", "accelerate"):
            assert "zero3_compile.hf.Trainer" in found.get(key, ""), found


def test_a_plain_trainer_refuses_to_resume_a_zero3_checkpoint():
    """It used to find no optimizer.pt and start a fresh optimizer in silence."""
    import peft
    import transformers

    zero3()
    checkpoint_dir = os.path.join(folder(), "zero3", "after", "checkpoint-2")
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint())
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    out = os.path.join(folder(), "plain-resume")
    trainer = transformers.Trainer(
        model=model, args=_args(out, 1, save_strategy="no", eval_strategy="no",
                                load_best_model_at_end=False), train_dataset=token_data()
    )  # fmt: skip
    with pytest.raises(Exception, match="resume_with_zero3_compile_hf_Trainer"):
        trainer.train(resume_from_checkpoint=checkpoint_dir)
    with pytest.raises(RuntimeError, match="Resume it with zero3_compile.hf.Trainer"):
        torch.load(os.path.join(checkpoint_dir, "optimizer.pt"), weights_only=False)


def test_a_mismatch_from_differing_shapes_names_the_shapes():
    for found in zero3()["refusals"]:
        message = found.get("shapes", "")
        assert "'1.weight' has different shapes on the ranks" in message, message
        assert "(2, 4) on rank 0, (3, 4) on rank 1" in message
        assert "set_leaf_modules" not in message
