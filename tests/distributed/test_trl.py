"""TRL 1.16's trainers on zero3 (``zero3_compile.hf.trl``, 2 gloo ranks) against the same TRL
trainer in one process on the same data: SFT, DPO (its reference model sharded), GRPO (generation
gathered and streamed, a deterministic reward and sampler), Reward; both orders of mixing
``z3hf.Trainer`` with a TRL trainer, arguments by position; a plain TRL trainer refusing a
sharded model."""

from __future__ import annotations

import functools
import os
import string
import tempfile
import time

import torch

from ..support.dist_utils import run_scenarios
from ..support.hf_models import VOCAB
from ..support.paths import EXAMPLES

# all of one length: every batch pads to the same shape, one compile per graph
TEXTS = [
    "hello world.",
    "the cat sat ",
    "zero3 shards",
    "abc def ghi.",
    "one two four",
    "lora adapter",
    "dpo prefers.",
    "grpo samples",
]
KINDS = ("sft", "dpo", "grpo", "reward")


@functools.cache
def folder() -> str:
    return tempfile.mkdtemp(prefix="zero3-trl-tests-")


def _config():
    """One layer: these tests are about the trainers around the model (compile time)."""
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, tie_word_embeddings=False, vocab_size=VOCAB,
        max_position_embeddings=64, pad_token_id=0, num_labels=1,
    )  # fmt: skip


@functools.cache
def checkpoints() -> dict[str, str]:
    import transformers

    paths = {"causal": os.path.join(folder(), "llama"), "reward": os.path.join(folder(), "score")}
    for kind, auto in (("causal", transformers.AutoModelForCausalLM),
                       ("reward", transformers.AutoModelForSequenceClassification)):  # fmt: skip
        torch.manual_seed(0)
        auto.from_config(_config()).save_pretrained(paths[kind])
    return paths


def tokenizer():
    """A character-level tokenizer within the test models' vocabulary (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for char in string.ascii_lowercase + string.digits + " .,!?":
        vocab[char] = len(vocab)
    model = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    model.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    model.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def _settings(out: str, world: int, kind: str) -> dict:
    settings = dict(
        output_dir=out,
        per_device_train_batch_size=4 // world,
        learning_rate=1e-2,
        max_steps=3 if kind != "grpo" else 2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_drop_last=True,
        use_cpu=True,
        disable_tqdm=True,
        optim="sgd",
        bf16=False,
    )
    if kind == "grpo":
        settings.update(max_completion_length=5, num_generations=2, shuffle_dataset=False)
    else:
        settings["max_length"] = 32
    return settings


def _reward(completions, **kwargs) -> list[float]:
    """Deterministic, and different for different texts (almost always)."""
    return [sum(ord(c) * (i + 1) for i, c in enumerate(text)) / 1000.0 for text in completions]


def _quantile_sampler(probs, num_samples=1, replacement=False, *, generator=None, out=None):
    """``torch.multinomial`` made deterministic for the comparison: row i takes the token at
    quantile 0.25 or 0.75 (i even, odd) of its distribution; GRPO's rows are the members of each
    group in turn on one process or two, so the completions match."""
    rows = probs.shape[0]
    quantile = 0.25 + 0.5 * (torch.arange(rows) % 2).to(probs.dtype)
    cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
    picked = (cdf < quantile[:, None]).sum(-1, keepdim=True)
    return picked.clamp(max=probs.shape[-1] - 1).expand(rows, num_samples)


def _trainer(namespace, kind: str, model, out: str, world: int, **extra):
    import datasets
    import trl

    settings = _settings(out, world, kind)
    if kind == "sft":
        data = datasets.Dataset.from_dict({"text": TEXTS})
        args = trl.SFTConfig(**settings)
        return namespace.SFTTrainer(model=model, args=args, train_dataset=data,
                                    processing_class=tokenizer(), **extra)  # fmt: skip
    if kind == "dpo":
        data = datasets.Dataset.from_dict(
            {
                "prompt": TEXTS,
                "chosen": [t[::-1] for t in TEXTS],
                "rejected": [t[:5] for t in TEXTS],
            }
        )
        args = trl.DPOConfig(**settings)
        return namespace.DPOTrainer(model=model, args=args, train_dataset=data,
                                    processing_class=tokenizer(), **extra)  # fmt: skip
    if kind == "grpo":
        data = datasets.Dataset.from_dict({"prompt": TEXTS})
        args = trl.GRPOConfig(**{**settings, **extra.pop("grpo", {})})
        return namespace.GRPOTrainer(model=model, reward_funcs=_reward, args=args,
                                     train_dataset=data, processing_class=tokenizer(), **extra)  # fmt: skip
    data = datasets.Dataset.from_dict({"chosen": TEXTS, "rejected": [t[:4] for t in TEXTS]})
    args = trl.RewardConfig(**settings)
    return namespace.RewardTrainer(model=model, args=args, train_dataset=data,
                                   processing_class=tokenizer(), **extra)  # fmt: skip


def _auto(kind: str):
    import transformers

    if kind == "reward":
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForCausalLM


def _path(kind: str) -> str:
    return checkpoints()["reward" if kind == "reward" else "causal"]


def _params(model) -> dict:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _logged(trainer) -> dict:
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h[key] for h in history] for key in ("loss", "grad_norm")}


def _train(trainer) -> None:
    sampler = torch.multinomial
    torch.multinomial = _quantile_sampler
    try:
        trainer.train()
    finally:
        torch.multinomial = sampler


# ------------------------------------------------------------------------ one process


def _plain(rank, world, kind, path, out):
    import trl

    start = time.process_time()
    torch.manual_seed(0)
    # SFT gets the model's path: TRL loads it (under zero3: sharded as it loads)
    model = path if kind == "sft" else _auto(kind).from_pretrained(path)
    trainer = _trainer(trl, kind, model, out, world)
    _train(trainer)
    return {"logged": _logged(trainer), "params": _params(trainer.model),
            "cpu_s": time.process_time() - start}  # fmt: skip


@functools.cache
def plain() -> dict:
    root = os.path.join(folder(), "plain")
    arg_list = [(kind, _path(kind), os.path.join(root, kind)) for kind in KINDS]
    results = run_scenarios(_plain, 1, arg_list, timeout=900)
    return {args[0]: per_rank[0] for args, per_rank in results.items()}


# ------------------------------------------------------------------------ zero3, 2 ranks


def _zero3_run(rank, world, kind, path, out, gather):
    from zero3_compile import hf as z3hf
    from zero3_compile.hf import trl as z3trl
    from zero3_compile.sharding.state import state_of

    torch.manual_seed(0)
    model = path if kind == "sft" else z3hf.from_pretrained(_auto(kind), path)
    extra = {"zero3_options": {"codegen": "eager"}}
    if kind == "grpo":
        extra["grpo"] = {"ds3_gather_for_generation": gather}
        if gather:  # generation inside an accumulation window (sync off): the same global batch
            extra["grpo"].update(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    trainer = _trainer(z3trl, kind, model, out, world, **extra)
    found = {}
    if kind == "dpo":  # built by TRL from the policy's name, loaded sharded
        ref = trainer.ref_model._orig_mod
        found["ref shards"] = [
            state_of(p) is not None and p.to_local().shape[0] < p.shape[0]
            for p in ref.parameters()
            if p.dim() and p.shape[0] > 1
        ]
    _train(trainer)
    if kind == "sft":  # loaded by TRL from the path
        found["loaded sharded"] = all(state_of(p) is not None for p in trainer.model.parameters())
    return {"logged": _logged(trainer), "params": _params(trainer.model), **found}


def _mixins(rank, world, path, out):
    """Both orders of mixing, arguments by position; a given unsharded reference model; a plain
    TRL trainer handed a sharded model."""
    import transformers
    import trl

    from zero3_compile import hf as z3hf
    from zero3_compile.hf import trl as z3trl
    from zero3_compile.sharding.state import state_of

    class First(z3hf.Trainer, trl.DPOTrainer):
        pass

    class Second(trl.DPOTrainer, z3hf.Trainer):
        pass

    auto = transformers.AutoModelForCausalLM
    found = {}
    for name, klass in (("first", First), ("second", Second), ("z3trl", z3trl.DPOTrainer)):
        policy = auto.from_pretrained(path)
        # a reference model given unsharded (sharded by the trainer), or sharded already
        given = z3hf.from_pretrained(auto, path) if name == "z3trl" else auto.from_pretrained(path)
        trainer = _trainer(_Positional(klass), "dpo", policy, os.path.join(out, name), world,
                           ref_model=given, zero3_options={"codegen": "eager"})  # fmt: skip
        found[name] = {
            "policy sharded": all(state_of(p) is not None for p in trainer.model.parameters()),
            "ref is the given one": getattr(trainer.ref_model, "_orig_mod", None) is given,
            "ref sharded": all(state_of(p) is not None for p in given.parameters()),
        }
    sharded = z3hf.from_pretrained(auto, path)
    plain_trl = _trainer(trl, "sft", sharded, os.path.join(out, "plain"), world)
    try:
        plain_trl.train()
    except TypeError as error:
        found["plain trl"] = str(error)
    return found


class _Positional:
    """Calls a DPO trainer class with (model, ref_model, args) by position, as TRL's docs do."""

    def __init__(self, klass):
        self.DPOTrainer = self._call(klass)

    @staticmethod
    def _call(klass):
        def build(model, args, ref_model=None, **kwargs):
            return klass(model, ref_model, args, **kwargs)

        return build


def _example(rank, world, out) -> str:
    """``examples/lora_trl.py`` as torchrun would run it (2 steps, eager codegen), in this rank's
    process: what it printed."""
    import contextlib
    import io
    import runpy
    import sys

    import torch.distributed as dist

    path = os.path.join(EXAMPLES, "lora_trl.py")
    init, destroy, argv = dist.init_process_group, dist.destroy_process_group, sys.argv
    dist.init_process_group = lambda *a, **k: None  # torchrun's group: the one made already
    dist.destroy_process_group = lambda *a, **k: None
    sys.argv = [path, "--out", out, "--steps", "2", "--codegen", "eager"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    finally:
        dist.init_process_group, dist.destroy_process_group, sys.argv = init, destroy, argv
    return printed.getvalue()


SCENARIOS = [
    ("sft", True),
    ("dpo", True),
    ("grpo", True),  # gathered for generation, with gradient accumulation
    ("grpo", False),  # streamed: each layer gathered as the forward reads it, ranks in step
    ("reward", True),
    ("mixins", True),
    ("example", True),
]


def _scenario(rank, world, kind, gather, path, root):
    # one process runs every scenario: the same code (a decorated forward) compiled for each
    # model and call shape would pass dynamo's per-function limit of 8 and fall back to eager
    torch._dynamo.config.recompile_limit = 64
    start = time.process_time()
    out = os.path.join(root, f"{kind}-{gather}")
    if kind == "mixins":
        found = _mixins(rank, world, path, out)
    elif kind == "example":
        found = {"printed": _example(rank, world, out)}
    else:
        found = _zero3_run(rank, world, kind, path, out, gather)
    found["cpu_s"] = time.process_time() - start  # this rank's CPU time (the suite's budget)
    return found


@functools.cache
def zero3() -> dict:
    root = os.path.join(folder(), "zero3")
    arg_list = [
        (kind, gather, _path("sft" if kind == "mixins" else kind), root)
        for kind, gather in SCENARIOS
    ]
    results = run_scenarios(_scenario, 2, arg_list, timeout=1800)
    return {(args[0], args[1]): per_rank for args, per_rank in results.items()}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _close(got: list[float], ref: list[float], tolerance: float) -> bool:
    return len(got) == len(ref) and all(abs(a - b) <= tolerance for a, b in zip(got, ref))


def _compare(kind: str, gather: bool = True) -> None:
    got, ref = zero3()[(kind, gather)][0], plain()[kind]
    assert _close(got["logged"]["loss"], ref["logged"]["loss"], 1e-5), (got["logged"], ref)
    assert _close(got["logged"]["grad_norm"], ref["logged"]["grad_norm"], 1e-4)
    scale = max(v.abs().max().item() for v in ref["params"].values())
    assert _max_diff(got["params"], ref["params"]) / scale < 1e-5


# ------------------------------------------------------------------------ tests


def test_sft_trains_like_trl_in_one_process():
    _compare("sft")
    for per_rank in zero3()[("sft", True)]:
        assert per_rank["loaded sharded"]  # TRL loaded the model from its path, into shards


def test_dpo_trains_like_trl_in_one_process_with_its_reference_model_sharded():
    _compare("dpo")
    for per_rank in zero3()[("dpo", True)]:
        assert per_rank["ref shards"] and all(per_rank["ref shards"])


def test_grpo_generates_gathered_and_trains_like_trl_in_one_process():
    _compare("grpo", gather=True)
    assert any(abs(g) > 0 for g in plain()["grpo"]["logged"]["grad_norm"])


def test_grpo_generates_streamed_and_trains_like_trl_in_one_process():
    _compare("grpo", gather=False)


def test_reward_trainer_trains_like_trl_in_one_process():
    _compare("reward")


def test_mixing_in_either_order_shards_policy_and_given_reference():
    for found in zero3()[("mixins", True)]:
        for name in ("first", "second", "z3trl"):
            assert found[name] == {
                "policy sharded": True,
                "ref is the given one": True,
                "ref sharded": True,
            }, (name, found[name])


def test_the_lora_trl_example_trains_saves_and_reloads():
    """examples/lora_trl.py (DPO with LoRA: the reference is the adapter disabled)."""
    printed = zero3()[("example", True)][0]["printed"]
    assert "dpo: losses" in printed, printed
    assert "(missing keys: []); same logits: True" in printed, printed


def test_a_plain_trl_trainer_refuses_a_sharded_model():
    for found in zero3()[("mixins", True)]:
        assert "zero3_compile.hf.trl" in found.get("plain trl", ""), found
