"""Activation checkpointing inside the model, and eval-mode inference, compiled and eager.
(Hugging Face models: tests/distributed/test_model_zoo.py.)"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import zero3_compile as z3
from zero3_compile.compiler.recording import record_graphs

from ..support.dist_utils import run_scenarios
from ..support.graph_checks import analyze
from ..support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from ..support.training import rel_diff


class CheckpointedGPT(GPT):
    """The test GPT with every block under torch.utils.checkpoint (activation checkpointing)."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.transformer.ln_f(x))


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
    # inductor inference: tests/distributed/test_equivalence.py (the MLP run)
    if codegen == "eager":
        model.eval()
        reference.eval()
        with torch.no_grad():
            compiled, eager, want = step(idx[mine]), model(idx[mine]), reference(idx[mine])
        out["inference_compiled"] = rel_diff(compiled, want)
        out["inference_eager"] = rel_diff(eager, want)
    return out


def _scenario(rank, world_size, kind, codegen):
    return _checkpointed_worker(rank, world_size, codegen)


# Inductor with checkpointed attention: tests/distributed/test_training_patterns.py
SCENARIOS = [("checkpointed", "eager")]


@functools.cache
def _scenarios():
    return run_scenarios(_scenario, 2, SCENARIOS)


def checkpointed_results(codegen):
    return _scenarios()[("checkpointed", codegen)]


@pytest.mark.parametrize("codegen", ["eager"])
def test_activation_checkpointing_inside_the_model(codegen):
    for r in checkpointed_results(codegen):
        assert r["grad_error"] <= (1e-5 if codegen == "eager" else 1e-4)
        assert r["graphs"]["forward"]["saved_gathered"] == []
        assert r["graphs"]["backward"]["all_gather"] > 0


def test_eval_mode_inference_under_no_grad():
    for r in checkpointed_results("eager"):
        assert r["inference_compiled"] <= 1e-5
        assert r["inference_eager"] <= 1e-6
