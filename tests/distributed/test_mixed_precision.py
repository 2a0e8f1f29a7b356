"""Mixed precision: bf16 gathers and compute, fp32 master shards, fp32 gradient reduction."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.func import functional_call

import zero3_compile as z3
from zero3_compile.compiler.recording import record_graphs
from zero3_compile.compiler.signature import collective_signature

from ..support.dist_utils import run_scenarios
from ..support.training import PER_RANK_BATCH, build, rel_diff

BF16 = torch.bfloat16


def emulated_reference_grads(model, loss_fn, batch, world_size, param_dtype, reduce_dtype):
    """The policy run unsharded in one process: each rank's slice computed in param_dtype, its
    gradient cast to reduce_dtype, summed over ranks, divided by N, cast to the master dtype."""
    names = dict(model.named_parameters())
    total = {n: None for n in names}
    for rank in range(world_size):
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        low = {
            n: p.detach().to(param_dtype).requires_grad_(p.requires_grad) for n, p in names.items()
        }
        inputs = tuple(t[mine] for t in batch)
        x = inputs[0].to(param_dtype) if inputs[0].is_floating_point() else inputs[0]

        def wrapped(idx, low=low):
            return functional_call(model, low, (idx,), tie_weights=True)

        loss_fn(wrapped, (x, inputs[1])).backward()
        for n, p in low.items():
            if p.grad is not None:
                g = p.grad.to(reduce_dtype or param_dtype)
                total[n] = g if total[n] is None else total[n] + g
    return {
        n: (g / world_size).to(torch.float32) if g is not None else None for n, g in total.items()
    }


def _mp_worker(rank, world_size, model_name, codegen):
    model, loss_fn, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    batch = make_batch(world_size * PER_RANK_BATCH, seed=0)
    expected = emulated_reference_grads(reference, loss_fn, batch, world_size, BF16, torch.float32)
    z3.shard(model, mp_policy=z3.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32))
    step = torch.compile(model, backend="zero3", options={"codegen": codegen})
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    with record_graphs() as records:
        loss = loss_fn(step, (batch[0][mine], batch[1][mine]))
        loss.backward()
    params = dict(model.named_parameters())
    return {
        "loss_dtype": str(loss.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted(
            {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        ),
        "grads": {
            n: params[n].grad.full_tensor() if params[n].grad is not None else None
            for n in expected
        },
        "expected": expected,
        "collectives": [entry for r in records for entry in collective_signature(r.gm.graph)],
    }


SCENARIOS = [("gpt", "eager"), ("mlp", "eager"), ("mlp", "inductor")]


@functools.cache
def _scenarios():
    return run_scenarios(_mp_worker, 2, SCENARIOS)


def results(model_name: str, codegen: str):
    return _scenarios()[(model_name, codegen)]


@pytest.mark.parametrize(
    "model_name,codegen", [("gpt", "eager"), ("mlp", "eager"), ("mlp", "inductor")]
)
def test_gradients_match_the_same_policy_run_unsharded(model_name, codegen):
    for r in results(model_name, codegen):
        assert r["param_dtypes"] == ["torch.float32"]  # fp32 master shards
        assert r["grad_dtypes"] == ["torch.float32"]
        # the GPT's logits come out in bf16 (its loss too); the MLP's loss is taken in fp32
        assert r["loss_dtype"] == ("torch.bfloat16" if model_name == "gpt" else "torch.float32")
        for name, want in r["expected"].items():
            got = r["grads"][name]
            if want is None:
                assert got is None
                continue
            assert rel_diff(got, want) <= 1e-2, f"{name}: {rel_diff(got, want):.3e}"


@pytest.mark.parametrize("model_name,codegen", [("gpt", "eager"), ("mlp", "inductor")])
def test_gathers_communicate_bf16_and_gradients_reduce_in_fp32(model_name, codegen):
    for r in results(model_name, codegen):
        gathers = [c for c in r["collectives"] if c[0] == "all_gather"]
        # reduce-scatters; on gloo, in-place all-reduces (collectives/schemes.py)
        reductions = [c for c in r["collectives"] if c[0].startswith(("reduce_scatter", "all_red"))]
        assert gathers and reductions
        assert {c[4] for c in gathers} == {"torch.bfloat16"}  # the shard is cast before the gather
        assert {c[4] for c in reductions} == {"torch.float32"}


def test_policy_and_shorthand_are_exclusive(fake_pg):
    with pytest.raises(ValueError, match="either mp_policy"):
        z3.shard(
            torch.nn.Linear(4, 4), param_dtype=BF16, mp_policy=z3.MixedPrecision(param_dtype=BF16)
        )
    with pytest.raises(ValueError, match="floating-point torch.dtype"):
        z3.shard(torch.nn.Linear(4, 4), param_dtype=torch.int8)
