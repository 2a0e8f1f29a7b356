"""The schedule: collective counts, prefetch overlap, release after last use, gathered memory."""

from __future__ import annotations

import math

import pytest
import torch

import zero3_compile as z3
from zero3_compile.compat import ALL_GATHER, WAIT
from zero3_compile.recording import record_graphs

from .models import GPT, GPTConfig, gpt_batch
from .runs import results


def _param_bytes(model_config: GPTConfig, world: int) -> int:
    model = GPT(model_config)
    return sum(
        math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) * 4
        for p in model.parameters()
    )


def test_collectives_per_step_within_bucket_bound_in_graphs_and_profiler():
    """At default options, all-gathers and reduce-scatters per pass are at most
    ceil(total bytes / bucket) + number of blocks; the profiler of a real step agrees."""
    config = GPTConfig()
    bound = math.ceil(_param_bytes(config, 2) / (25 * 2**20)) + config.n_layer
    for per_rank in results(2, "inductor"):
        run = per_rank["gpt/sgd/c"]
        graphs = run["graphs"]
        forward_gathers = graphs["forward"]["all_gather"]
        backward_gathers = graphs["backward"]["all_gather"]
        reduce_scatters = graphs["backward"]["reduce_scatter"]
        assert 0 < forward_gathers <= bound
        assert 0 < backward_gathers <= bound
        assert 0 < reduce_scatters <= bound
        # gloo runs a reduce-scatter as an all-reduce underneath; each graph also runs one
        # cross-rank check (a small all-gather on the side group)
        checks = 2
        assert (
            run["profiled"].get("gloo:all_gather", 0) == forward_gathers + backward_gathers + checks
        )
        assert run["profiled"].get("gloo:all_reduce", 0) == reduce_scatters


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_each_parameter_is_gathered_once_in_forward_and_reduced_once_in_backward(codegen):
    """The tied embedding / head weight too: one gather per forward, one reduce per step."""
    names = set(GPT().state_dict()) - {"lm_head.weight"}  # tied to transformer.wte.weight
    for per_rank in results(2, codegen):
        graphs = per_rank["gpt/sgd/c"]["graphs"]
        gathered = graphs["forward"]["gathered_params"]
        reduced = graphs["backward"]["reduced_params"]
        assert sorted(gathered) == sorted(names)
        assert sorted(reduced) == sorted(names)


def test_inductor_code_overlaps_gathers_with_compute_and_frees_them_after_last_use():
    for per_rank in results(2, "inductor"):
        graphs = per_rank["gpt/sgd/c"]["graphs"]
        for kind in ("forward", "backward"):
            report = graphs[kind]["inductor_gathers"]
            assert report, kind
            for gather in report:
                assert gather["freed"], (kind, gather)
                assert gather["kernels_between_last_read_and_free"] == 0, (kind, gather)
            # prefetch_depth=1: every gather but the first has compute between issue and wait
            assert sum(g["overlapped"] for g in report) >= len(report) - 1, (kind, report)


def _gathered_intervals(gm: torch.fx.GraphModule) -> list[tuple[int, int, int]]:
    """(issue position, last use position, bytes) of every all-gather's gathered values.

    Gathered values: the wait and every node computed from it without other inputs (views,
    copy-outs, transposes); the interval ends at the last node reading any of them.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    intervals = []
    for ag in (n for n in nodes if n.target is ALL_GATHER):
        (wait,) = ag.users
        assert wait.target is WAIT
        derived, frontier = {wait}, [wait]
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if (
                    user not in derived
                    and user.op == "call_function"
                    and set(user.all_input_nodes) <= derived
                ):
                    derived.add(user)
                    frontier.append(user)
        last = max(pos[u] for d in derived for u in d.users)
        val = ag.meta["val"]
        intervals.append((pos[ag], last, val.numel() * val.element_size()))
    return sorted(intervals)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_peak_gathered_bytes_at_most_depth_plus_one_consecutive_buckets(fake_pg, depth):
    """Liveness of the forward graph: with prefetch depth d, the gathered parameters alive at any
    point are at most those of d + 1 consecutive buckets (here one bucket per block)."""
    torch.manual_seed(0)
    model = z3.shard(GPT(GPTConfig(n_layer=4, tie_embeddings=False)))
    step = torch.compile(
        model, backend="zero3", options={"codegen": "eager", "prefetch_depth": depth}
    )
    idx, _ = gpt_batch(2)
    with record_graphs() as records:
        step(idx)
    (forward,) = [r for r in records if r.kind == "forward"]
    intervals = _gathered_intervals(forward.gm)
    assert len(intervals) == 4  # one bucket per block (embeddings join block 0, the head block 3)
    sizes = [size for _, _, size in intervals]
    bound = max(sum(sizes[i : i + depth + 1]) for i in range(len(sizes)))
    positions = sorted({p for start, end, _ in intervals for p in (start, end)})
    peak = max(sum(size for start, end, size in intervals if start <= p <= end) for p in positions)
    assert peak <= bound, (peak, bound, intervals)
    if depth > 0:  # and prefetching does overlap: more than one bucket is alive at some point
        assert peak > max(sizes)
