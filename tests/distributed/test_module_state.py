"""What shard() leaves on a model: picklable, deep-copyable, state owned per model (2 ranks)."""

from __future__ import annotations

import copy
import functools
import io

import torch

import zero3_compile as z3
from zero3_compile.sharding.state import state_of

from ..support.dist_utils import run_ranks
from ..support.models import GPT, gpt_batch, gpt_loss
from ..support.training import rel_diff


def _compiled(model):
    return torch.compile(model, backend="zero3", options={"codegen": "eager"})


def _scenario(rank, world_size):
    torch._dynamo.reset()
    torch.manual_seed(0)
    batch = gpt_batch(2, seed=rank)
    model = z3.shard(GPT(), sync_timeout_s=120)
    reference = gpt_loss(_compiled(model), batch)
    out = {}

    # torch.save(model) / torch.load: a sharded model again, tied weights still tied
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    head = loaded.lm_head._parameters["weight"]
    out["loaded_sharded"] = state_of(head) is not None and state_of(head).param is head
    out["loaded_tied"] = head is loaded.transformer.wte._parameters["weight"]
    out["loaded_loss"] = gpt_loss(_compiled(loaded), batch).item()
    out["loss"] = reference.item()

    # deepcopy: an independent model (training the copy leaves the original alone)
    twin = copy.deepcopy(model)
    before = z3.full_state_dict(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    gpt_loss(_compiled(twin), batch).backward()
    opt.step()
    after = z3.full_state_dict(model)
    out["original_untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    out["twin_moved"] = any(
        not torch.equal(v, before[k]) for k, v in z3.full_state_dict(twin).items()
    )

    # a student and its teacher in one compiled function: the same parameter names, different
    # parameters; no gather may be merged across them
    def distill(idx):
        return model(idx).float().square().mean() + twin(idx).float().square().mean()

    compiled_value = _compiled(distill)(batch[0])
    with torch.no_grad():
        eager_value = distill(batch[0])
    out["distill_error"] = rel_diff(compiled_value.detach(), eager_value)

    # explain() compiles and runs a backward on its own model only: other models' gradients stay
    for p in model.parameters():
        p.grad = None
    gpt_loss(_compiled(twin), batch).backward()
    twin_grads = {n: p.grad.to_local().clone() for n, p in twin.named_parameters()}
    report = z3.explain(_compiled(model), batch[0])
    out["explain_graphs"] = len(report.graphs)
    out["explain_left_own_grads"] = all(p.grad is None for p in model.parameters())
    out["explain_left_other_grads"] = all(
        torch.equal(twin_grads[n], p.grad.to_local()) for n, p in twin.named_parameters()
    )
    return out


@functools.cache
def results():
    return run_ranks(_scenario, 2, timeout=600)


def test_torch_save_and_load_of_a_sharded_model():
    for r in results():
        assert r["loaded_sharded"] and r["loaded_tied"]
        assert r["loaded_loss"] == r["loss"]


def test_deepcopy_is_an_independent_sharded_model():
    for r in results():
        assert r["original_untouched"] and r["twin_moved"]


def test_two_copies_of_a_model_in_one_graph_are_not_merged():
    for r in results():
        assert r["distill_error"] <= 1e-6


def test_explain_leaves_every_gradient_as_it_found_it():
    for r in results():
        assert r["explain_graphs"] >= 2
        assert r["explain_left_own_grads"] and r["explain_left_other_grads"]
