"""Real models: Hugging Face GPT-2 and Llama from a config (no download), activation
checkpointing inside the model, and eval-mode inference, compiled and eager."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import zero3_compile as z3
from zero3_compile.recording import record_graphs

from .dist_utils import run_scenarios
from .graph_checks import analyze
from .models import GPT, GPTConfig, gpt_batch, gpt_loss
from .training import rel_diff

transformers = pytest.importorskip("transformers")

STEPS = 3


def build_hf(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=97,
            n_positions=32,
            n_embd=24,
            n_layer=2,
            n_head=4,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


class CheckpointedGPT(GPT):
    """The test GPT with every block under torch.utils.checkpoint (activation checkpointing)."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.transformer.ln_f(x))


def _hf_worker(rank, world_size, kind):
    model = build_hf(kind)
    reference = copy.deepcopy(model)
    z3.shard(model)
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ids = torch.randint(0, 97, (2 * world_size, 16), generator=torch.Generator().manual_seed(0))
    mine = ids[2 * rank : 2 * rank + 2]
    out = {"losses": [], "ref_losses": []}
    for i in range(STEPS):
        loss = step(input_ids=mine, labels=mine).loss
        loss.backward()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        if i == 0:
            params = dict(model.named_parameters())
            out["grad_error"] = max(
                rel_diff(params[n].grad.full_tensor(), p.grad)
                for n, p in reference.named_parameters()
            )
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        out["losses"].append(total.item() / world_size)
        out["ref_losses"].append(ref_loss.item())
    return out


def _checkpointed_worker(rank, world_size, codegen):
    torch.manual_seed(0)
    model = CheckpointedGPT(GPTConfig(n_layer=1))
    reference = copy.deepcopy(model)
    z3.shard(model)
    step = torch.compile(model, backend="zero3", options={"codegen": codegen})
    idx, targets = gpt_batch(2 * world_size)
    mine = slice(2 * rank, 2 * rank + 2)
    with record_graphs() as records:
        gpt_loss(step, (idx[mine], targets[mine])).backward()
    gpt_loss(reference, (idx, targets)).backward()
    params = dict(model.named_parameters())
    grad_error = max(
        rel_diff(params[n].grad.full_tensor(), p.grad) for n, p in reference.named_parameters()
    )
    out = {"grad_error": grad_error, "graphs": analyze(records)}
    if codegen == "eager":  # inductor inference: tests/test_equivalence.py (the MLP run)
        model.eval()
        reference.eval()
        with torch.no_grad():
            compiled, eager, want = step(idx[mine]), model(idx[mine]), reference(idx[mine])
        out["inference_compiled"] = rel_diff(compiled, want)
        out["inference_eager"] = rel_diff(eager, want)
    return out


def _scenario(rank, world_size, kind, codegen):
    if kind in ("gpt2", "llama"):
        return _hf_worker(rank, world_size, kind)
    return _checkpointed_worker(rank, world_size, codegen)


SCENARIOS = [
    ("gpt2", "eager"),
    ("llama", "eager"),
    ("checkpointed", "eager"),
    ("checkpointed", "inductor"),
]


@functools.cache
def _scenarios():
    return run_scenarios(_scenario, 2, SCENARIOS)


def hf_results(kind):
    return _scenarios()[(kind, "eager")]


def checkpointed_results(codegen):
    return _scenarios()[("checkpointed", codegen)]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_model_trains_like_eager(kind):
    for r in hf_results(kind):
        assert r["grad_error"] <= 1e-5
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
        assert r["ref_losses"][-1] < r["ref_losses"][0]


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_activation_checkpointing_inside_the_model(codegen):
    for r in checkpointed_results(codegen):
        assert r["grad_error"] <= (1e-5 if codegen == "eager" else 1e-4)
        assert r["graphs"]["forward"]["saved_gathered"] == []
        assert r["graphs"]["backward"]["all_gather"] > 0


def test_eval_mode_inference_under_no_grad():
    for r in checkpointed_results("eager"):
        assert r["inference_compiled"] <= 1e-5
        assert r["inference_eager"] <= 1e-6
