"""Warm restarts: a second process start with the same cache directory loads the compiled graphs
from AOTAutograd's and Inductor's caches, still runs the cross-rank check, and never reuses a
schedule compiled for other options or another world size."""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest
import torch

import zero3_compile as z3
from zero3_compile.guard import CollectiveMismatchError

from .dist_utils import run_ranks
from .models import FrozenMLP, mlp_batch, mlp_loss

A = {"codegen": "inductor"}
B = {"codegen": "inductor", "bucket_mb": 0.0002}  # one parameter per collective: other graphs


def _run(rank, world_size, options_by_rank):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = z3.shard(FrozenMLP(), sync_timeout_s=60)
    step = torch.compile(model, backend="zero3", options=options_by_rank[rank])
    inputs, targets = mlp_batch(2 * world_size, seed=rank)
    try:
        loss = mlp_loss(step, (inputs, targets))
        loss.backward()
    except Exception as error:  # noqa: BLE001
        while error is not None and not isinstance(error, CollectiveMismatchError):
            error = getattr(error, "inner_exception", None) or error.__cause__
        return {"error": str(error) if error is not None else "other error"}
    return {
        "loss": loss.item(),
        "grad": model.layers[2]._parameters["weight"].grad.to_local().clone(),
        "aot": dict(counters["aot_autograd"]),
        "fx": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
    }


@functools.cache
def runs():
    cache = tempfile.mkdtemp(prefix="zero3-cache-test-")
    env = {"TORCHINDUCTOR_CACHE_DIR": cache}
    try:
        return {
            "cold": run_ranks(_run, 2, [A, A], env=env, timeout=900),
            "warm": run_ranks(_run, 2, [A, A], env=env, timeout=900),
            "other_options": run_ranks(_run, 2, [B, B], env=env, timeout=900),
            "other_world": run_ranks(_run, 3, [A, A, A], env=env, timeout=900),
            "mismatch": run_ranks(_run, 2, [A, B], env=env, timeout=900),
        }
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_cold_start_compiles_and_saves():
    for r in runs()["cold"]:
        assert r["aot"].get("autograd_cache_miss", 0) >= 1
        assert r["aot"].get("autograd_cache_saved", 0) >= 1


def test_warm_restart_loads_from_the_caches_and_trains_the_same():
    for cold, warm in zip(runs()["cold"], runs()["warm"]):
        assert warm["aot"].get("autograd_cache_hit", 0) >= 1, warm["aot"]
        assert warm["aot"].get("autograd_cache_miss", 0) == 0, warm["aot"]
        assert warm["fx"].get("fxgraph_cache_hit", 0) >= 1, warm["fx"]
        assert warm["loss"] == cold["loss"]
        assert torch.equal(warm["grad"], cold["grad"])


@pytest.mark.parametrize("run", ["other_options", "other_world"])
def test_other_options_or_world_size_never_reuse_a_schedule(run):
    for r in runs()[run]:
        assert r["aot"].get("autograd_cache_hit", 0) == 0, (run, r["aot"])
        assert r["aot"].get("autograd_cache_miss", 0) >= 1


def test_a_cache_hit_still_runs_the_cross_rank_check():
    """Each rank loads its own cached graphs (rank 0 the ones of options A, rank 1 of B): the
    check in the cached code turns the mismatch into an error on both ranks."""
    for r in runs()["mismatch"]:
        assert "about to issue different collectives" in r["error"], r
