"""Warm restarts: a second process start with the same cache directory loads the compiled graphs
from AOTAutograd's and Inductor's caches, still runs the cross-rank check, and never reuses a
schedule compiled for other options or another world size."""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest
import torch
from torch import nn

import zero3_compile as z3
from zero3_compile.runtime.guard import CollectiveMismatchError

from ..support.dist_utils import run_ranks
from ..support.models import GPT, FrozenMLP, GPTConfig, gpt_batch, gpt_loss, mlp_batch, mlp_loss

A = {"codegen": "inductor"}
B = {"codegen": "inductor", "bucket_mb": 0.0002}  # one parameter per collective: other graphs


class Heads(nn.Module):
    """Three heads: every rank's loss reads ``used``, rank 1's also ``rank1``, none ``never``.
    Whether a parameter gets a gradient is the union over ranks, which the backward graph's guard
    exchanges at run time (runtime.py): ``rank1`` gets one on every rank, ``never`` on none."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.used = nn.Linear(16, 4)
        self.rank1 = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.used(h), self.rank1(h), self.never(h)


def _run(rank, world_size, options_by_rank, unrelated_first=False):
    """FrozenMLP and Heads, one step each. ``unrelated_first``: compile another model first,
    so that this process's compile counters differ from those of the process that filled the
    cache (nothing process-local may be baked into cached code)."""
    from torch._dynamo.utils import counters

    options = options_by_rank[rank]
    if unrelated_first:
        other = torch.compile(z3.shard(nn.Linear(4, 6)), backend="zero3", options=options)
        other(torch.randn(2, 4)).sum().backward()
    before = {k: dict(counters[k]) for k in ("aot_autograd", "inductor")}
    torch.manual_seed(0)
    model = z3.shard(FrozenMLP(), sync_timeout_s=60)
    step = torch.compile(model, backend="zero3", options=options)
    inputs, targets = mlp_batch(2 * world_size, seed=rank)
    heads = z3.shard(Heads(), sync_timeout_s=60)
    heads_step = torch.compile(heads, backend="zero3", options=options)
    try:
        loss = mlp_loss(step, (inputs, targets))
        loss.backward()
        used, rank1, _never = heads_step(
            torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
        )
        (used.square().sum() + (rank1.sum() if rank == 1 else 0)).backward()
    except Exception as error:  # noqa: BLE001
        while error is not None and not isinstance(error, CollectiveMismatchError):
            error = getattr(error, "inner_exception", None) or error.__cause__
        return {"error": str(error) if error is not None else "other error"}

    def delta(kind):
        return {k: v - before[kind].get(k, 0) for k, v in counters[kind].items()}

    return {
        "loss": loss.item(),
        "grad": model.layers[2]._parameters["weight"].grad.to_local().clone(),
        "heads_grads": {
            name: None if p.grad is None else p.grad.to_local().clone()
            for name, p in heads.named_parameters()
        },
        "aot": delta("aot_autograd"),
        "fx": {k: v for k, v in delta("inductor").items() if k.startswith("fxgraph_cache")},
    }


def _gpt_recorded(rank, world_size):
    """One step of a one-block GPT (its graphs take the parameters' DeviceMesh) under
    ``record_graphs``, which compiles past AOTAutograd's cache: only Inductor's can hit."""
    from torch._dynamo.utils import counters

    from zero3_compile.compiler.recording import record_graphs

    torch.manual_seed(0)
    model = z3.shard(GPT(GPTConfig(n_layer=1)), sync_timeout_s=60)
    step = torch.compile(model, backend="zero3", options=A)
    before = dict(counters["inductor"])
    with record_graphs():
        loss = gpt_loss(step, gpt_batch(2, seed=rank))
        loss.backward()
    fx = {k: v - before.get(k, 0) for k, v in counters["inductor"].items()}
    return {
        "loss": loss.item(),
        "grad": model.lm_head.weight.grad.to_local().clone(),
        "fx": {k: v for k, v in fx.items() if k.startswith("fxgraph_cache")},
    }


def _then_gpt(rank, world_size, options_by_rank, unrelated_first=False):
    """``_run``, then ``_gpt_recorded`` in the same processes (their figures are each their own:
    counted from before their compiles)."""
    return _run(rank, world_size, options_by_rank, unrelated_first), _gpt_recorded(rank, world_size)


def _in_turn(rank, world_size, *options):
    """``_run`` with each of ``options`` (options by rank) in turn, in the same processes."""
    return [_run(rank, world_size, by_rank) for by_rank in options]


def _split(per_rank: list) -> tuple[list, ...]:
    """Per-rank tuples of results into a per-rank list of each."""
    return tuple(list(each) for each in zip(*per_rank))


@functools.cache
def runs():
    cache = tempfile.mkdtemp(prefix="zero3-cache-test-")
    env = {"TORCHINDUCTOR_CACHE_DIR": cache}
    try:
        cold, gpt_cold = _split(run_ranks(_then_gpt, 2, [A, A], env=env, timeout=900))
        # a restart: spawned with a hash seed of its own (forked ranks share the fork
        # server's, so a key hashing per-process values would still match)
        warm, gpt_warm = _split(
            run_ranks(_then_gpt, 2, [A, A], True, env={**env, "PYTHONHASHSEED": "1"}, timeout=900)
        )
        # options B compiled first, so that in the mismatch each rank loads its own cached
        # graphs (rank 0 those of A, from the cold start, rank 1 those of B)
        other_options, mismatch = _split(
            run_ranks(_in_turn, 2, [B, B], [A, B], env=env, timeout=900)
        )
        return {
            "cold": cold,
            "warm": warm,
            "other_options": other_options,
            "other_world": run_ranks(_run, 3, [A, A, A], env=env, timeout=900),
            "mismatch": mismatch,
            "gpt_cold": gpt_cold,
            "gpt_warm": gpt_warm,
        }
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_cold_start_compiles_and_saves():
    for r in runs()["cold"]:
        assert r["aot"].get("autograd_cache_miss", 0) >= 1
        assert r["aot"].get("autograd_cache_saved", 0) >= 1


def test_warm_restart_loads_from_the_caches_and_trains_the_same():
    for cold, warm in zip(runs()["cold"], runs()["warm"]):
        # both caches, on torch 2.11 too since the mesh's cache key holds nothing per process
        # (_torch.inductor.stable_mesh_cache_keys)
        assert warm["aot"].get("autograd_cache_hit", 0) >= 1, warm["aot"]
        assert warm["aot"].get("autograd_cache_miss", 0) == 0, warm["aot"]
        assert warm["fx"].get("fxgraph_cache_miss", 0) == 0, warm["fx"]
        assert warm["fx"].get("fxgraph_cache_hit", 0) >= 1, warm["fx"]
        assert warm["loss"] == cold["loss"]
        assert torch.equal(warm["grad"], cold["grad"])
        for name, grad in cold["heads_grads"].items():
            if name.startswith("never."):  # no rank's loss reached it: no gradient, as eager
                assert grad is None and warm["heads_grads"][name] is None, name
            else:  # rank1: reached on rank 1 only, reduced onto every rank
                assert grad is not None, name
                assert warm["heads_grads"][name] is not None, name
                assert torch.equal(warm["heads_grads"][name], grad), name


def test_graphs_taking_the_mesh_hit_inductors_cache_in_a_new_process():
    """The parameters' DeviceMesh, a graph input, pickles a hash of strings (which differs with
    the process's hash seed);
    Inductor's cache must still hit for the forward and the backward graph in a new process
    (``_torch.inductor.stable_mesh_cache_keys``), with the same results."""
    for cold, warm in zip(runs()["gpt_cold"], runs()["gpt_warm"]):
        assert cold["fx"].get("fxgraph_cache_miss", 0) == 2, cold["fx"]
        assert warm["fx"].get("fxgraph_cache_miss", 0) == 0, warm["fx"]
        assert warm["fx"].get("fxgraph_cache_hit", 0) == 2, warm["fx"]
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


def test_a_mesh_is_keyed_by_what_identifies_its_collectives(fake_pg, monkeypatch):
    """The cache key of a mesh: equal for equal meshes, different for another world; a mesh that
    cannot name its groups falls back to torch's own reduction instead of failing the compile."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from zero3_compile._torch.inductor import _mesh_cache_key, _only_a_cache_key

    mesh = init_device_mesh("cpu", (4,))
    again = init_device_mesh("cpu", (4,))
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hash(mesh)  # the per-process hash the key must not hold
    assert _mesh_cache_key(mesh)[0] is _only_a_cache_key
    assert _mesh_cache_key(mesh) == _mesh_cache_key(again)
    assert _mesh_cache_key(two) != _mesh_cache_key(mesh)
    assert str(hash(mesh)) not in repr(_mesh_cache_key(mesh))

    def gone(self):
        raise RuntimeError("group destroyed")

    monkeypatch.setattr(DeviceMesh, "get_all_groups", gone)
    assert _mesh_cache_key(mesh)[0] is not _only_a_cache_key
