"""Real training code: every pattern FSDP2 and DeepSpeed users write trains like single-process
eager training, or fails loudly on every rank (2 gloo ranks; uncompiled, eager codegen, Inductor).
"""

from __future__ import annotations

import functools

import pytest
import torch

from ..support.dist_utils import run_scenarios
from ..support.patterns import run_scenario
from ..support.training import rel_diff

TOLERANCE = {None: 1e-5, "eager": 1e-5, "inductor": 1e-4}

CASES = [
    ("no_grad_first", None),
    ("no_grad_first", "eager"),
    ("unused_output", None),
    ("unused_output", "eager"),
    ("unused_output", "inductor"),
    ("writes_after_shard", "eager"),
    ("write_in_compiled_forward", "eager"),
    ("moe", None),
    ("moe", "eager"),
    ("moe", "inductor"),
    ("moe", "eager", "ffns"),  # not named like experts: not detected, not annotated
    ("moe", None, "ffns"),
    ("moe", "eager", "ffns", True),  # annotated with set_leaf_modules
    ("variable_lengths", "eager"),
    ("variable_lengths", "inductor"),
    ("checkpointed_attention", "eager", "function"),
    ("checkpointed_attention", "eager", "wrapper"),
    ("checkpointed_attention", "inductor", "function"),
    ("casts", "eager"),
    ("assigned_after_shard", "eager"),
    ("assigned_after_shard", None),
    ("recurrent", None, "lstm"),
    ("recurrent", "eager", "gru"),
]


@functools.cache
def _results():
    return run_scenarios(run_scenario, 2, CASES, timeout=1800)


def results(*case):
    return _results()[tuple(case)]


def check_matches_eager(per_rank, tol):
    """Gradients (values, and None exactly where eager has None), losses and final parameters."""
    for rank, r in enumerate(per_rank):
        assert "error" not in r, r.get("error")
        for step, (grads, ref_grads) in enumerate(zip(r["grads"], r["ref_grads"])):
            for name, want in ref_grads.items():
                got = grads[name]
                if want is None:
                    assert got is None, (
                        f"rank {rank} step {step}: {name} has a gradient, eager None"
                    )
                    continue
                assert got is not None, f"rank {rank} step {step}: {name} is None, eager is not"
                assert rel_diff(got, want) <= tol, (
                    f"rank {rank} step {step} {name}: {rel_diff(got, want):.2e}"
                )
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= tol * max(abs(want), 1e-3), (r["losses"], r["ref_losses"])
        for name, want in r["ref_params"].items():
            assert rel_diff(r["params"][name], want) <= tol, f"rank {rank} param {name}"


@pytest.mark.parametrize("codegen", [None, "eager"])
def test_layer_used_under_no_grad_first_then_with_grad_trains_like_eager(codegen):
    per_rank = results("no_grad_first", codegen)
    check_matches_eager(per_rank, TOLERANCE[codegen])
    assert all(g is not None for g in per_rank[0]["grads"][0].values())


@pytest.mark.parametrize("codegen", [None, "eager", "inductor"])
def test_unused_output_leaves_grad_none_and_parameters_untouched(codegen):
    per_rank = results("unused_output", codegen)
    check_matches_eager(per_rank, TOLERANCE[codegen])
    for r in per_rank:
        for grads in r["grads"]:
            assert grads["extra.weight"] is None and grads["extra.bias"] is None
            assert grads["main.weight"] is not None
        # AdamW's weight decay did not touch the unused head
        assert torch.equal(r["params"]["extra.weight"], r["ref_params"]["extra.weight"])


def test_writes_to_parameters_after_shard_reach_the_shards():
    per_rank = results("writes_after_shard", "eager")
    for r in per_rank:
        for key in ("after_edit", "after_ema"):
            for name, want in r[f"ref_{key}"].items():
                assert torch.allclose(r[key][name], want, atol=1e-6), (key, name)
        # and the edits are not no-ops: the re-initialised values differ from the originals
        assert r["after_edit"]["0.bias"].eq(0.5).all()
    check_matches_eager(per_rank, 1e-5)


def test_in_place_write_inside_compiled_forward_is_refused_with_the_fix():
    for message in results("write_in_compiled_forward", "eager"):
        assert "writes in place to parameter 'lin.weight'" in message, message
        assert "outside the compiled region" in message


@pytest.mark.parametrize("codegen", [None, "eager", "inductor"])
def test_mixture_of_experts_with_data_dependent_routing_trains_like_eager(codegen):
    per_rank = results("moe", codegen)
    check_matches_eager(per_rank, TOLERANCE[codegen])
    for r in per_rank:  # expert 3 got no token on any rank: no gradient, as in eager
        assert r["grads"][0]["moe.experts.3.w1.weight"] is None
        assert r["grads"][0]["moe.experts.0.w1.weight"] is not None  # rank 0's tokens only


@pytest.mark.parametrize("codegen", [None, "eager"])
def test_undetected_data_dependent_experts_fail_on_every_rank_naming_them(codegen):
    for r in results("moe", codegen, "ffns"):
        message = r["error"]
        assert "about to issue different collectives" in message, message
        assert "moe.ffns." in message
        assert "set_leaf_modules" in message


def test_set_leaf_modules_makes_any_expert_block_train_like_eager():
    check_matches_eager(results("moe", "eager", "ffns", True), 1e-5)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_per_rank_varying_sequence_lengths_train_like_eager(codegen):
    check_matches_eager(results("variable_lengths", codegen), TOLERANCE[codegen])


@pytest.mark.parametrize(
    "codegen,how", [("eager", "function"), ("eager", "wrapper"), ("inductor", "function")]
)
def test_activation_checkpointing_around_attention_blocks(codegen, how):
    check_matches_eager(results("checkpointed_attention", codegen, how), TOLERANCE[codegen])


def test_casting_and_moving_a_sharded_model():
    per_rank = results("casts", "eager")
    for r in per_rank:
        assert r["dtypes"] == [
            ["torch.float64"],
            ["torch.float16"],
            ["torch.bfloat16"],
            ["torch.float32"],
            ["torch.float32"],
        ]
        assert r["bf16_grad_dtypes"] == ["torch.bfloat16"]
    check_matches_eager(per_rank, 1e-5)


@pytest.mark.parametrize("codegen", [None, "eager"])
def test_parameters_and_modules_assigned_after_shard_are_sharded_and_tied(codegen):
    per_rank = results("assigned_after_shard", codegen)
    for r in per_rank:
        assert r["sharded"] == {"scale": True, "head": True, "tied": True}
    check_matches_eager(per_rank, 1e-5)


@pytest.mark.parametrize("codegen,cell", [(None, "lstm"), ("eager", "gru")])
def test_recurrent_layers_train_like_eager_and_keep_no_full_weights(codegen, cell):
    per_rank = results("recurrent", codegen, cell)
    check_matches_eager(per_rank, 1e-5)
    for r in per_rank:
        assert r["kept_full_weights"] == []
        links, base = r["base_chain"]
        assert links < 8 and base != "GatheredParameter", r["base_chain"]
