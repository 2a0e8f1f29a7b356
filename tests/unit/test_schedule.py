"""The schedule: collective counts, prefetch overlap, release after last use, gathered memory."""

from __future__ import annotations

import math

import pytest
import torch

import zero3_compile as z3
from zero3_compile._torch.c10d import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, WAIT
from zero3_compile.compiler.graph_facts import gathered_values
from zero3_compile.compiler.recording import record_graphs
from zero3_compile.compiler.signature import most_in_flight, scheduled_events

from ..support.models import GPT, GPTConfig, gpt_batch
from ..support.runs import results


def _param_bytes(model_config: GPTConfig, world: int) -> int:
    model = GPT(model_config)
    return sum(
        math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) * 4
        for p in model.parameters()
    )


def test_collectives_per_step_within_bucket_bound_in_graphs_and_profiler():
    """At default options (bucket_mb=5: the whole test GPT fits one bucket), all-gathers and
    reduce-scatters per pass are at most ceil(total bytes / bucket) + number of blocks; the
    profiler of a real step agrees. The cap itself: test_bucket_cap_..."""
    config = GPTConfig()
    bound = math.ceil(_param_bytes(config, 2) / z3.Options().bucket_bytes) + config.n_layer
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


def test_bucket_cap_splits_blocks_and_is_never_exceeded(fake_pg):
    """With a cap smaller than a block, every bucket stays within it (unless it holds a single
    larger parameter) and buckets are as full as the cap allows: the next bucket's first
    parameter would not have fitted in the previous one (within a block)."""
    from zero3_compile.compiler.node_keys import BUCKET, PARAMS

    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, tie_embeddings=False)
    model = z3.shard(GPT(config))
    sizes = {
        n: math.ceil(p.shape[0] / 4) * 4 * math.prod(p.shape[1:]) * 4
        for n, p in model.named_parameters()
    }
    block_bytes = sum(v for n, v in sizes.items() if n.startswith("transformer.h.0."))
    cap = block_bytes // 3
    step = torch.compile(
        model, backend="zero3", options={"codegen": "eager", "bucket_mb": cap / 2**20}
    )
    with record_graphs() as records:
        step(gpt_batch(2, config)[0])
    (forward,) = [r for r in records if r.kind == "forward"]
    buckets = [
        (node.meta[BUCKET], list(node.meta[PARAMS]))
        for node in forward.gm.graph.nodes
        if node.target is ALL_GATHER
    ]
    assert len(buckets) >= 3 * config.n_layer  # the cap split every block into several buckets
    for (_, names), (_, following) in zip(buckets, buckets[1:]):
        total = sum(sizes[n] for n in names)
        assert total <= cap or len(names) == 1, (names, total, cap)
        same_block = following[0].split(".")[:3] == names[-1].split(".")[:3]
        if same_block:
            assert total + sizes[following[0]] > cap, (names, following[0])


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


# (job, graph kind) of the inductor graphs whose generated code the schedule tests read: training
# graphs, and an inference graph (no_grad), which Inductor's post-grad passes treat differently
INDUCTOR_GRAPHS = [
    ("gpt/sgd/c", "forward"),
    ("gpt/sgd/c", "backward"),
    ("mlp/sgd/option1", "forward"),
    ("mlp/sgd/option1", "backward"),
    ("mlp/sgd/option1", "inference"),
]


def test_inductor_code_issues_and_waits_exactly_where_the_schedule_does():
    """Issue and wait of every collective, and the guard first, in the scheduled order: Inductor
    moved nothing (its peak-memory and locality reorderings and 2.14's simple-overlap pass are
    off). The scheduled order is the graph as recorded before Inductor ran."""
    for per_rank in results(2, "inductor"):
        for job, kind in INDUCTOR_GRAPHS:
            graphs = per_rank[job]["graphs"][kind]
            assert graphs["generated_events"], (job, kind)
            for generated, scheduled in zip(graphs["generated_events"], graphs["scheduled_events"]):
                assert generated == scheduled, (job, kind, generated, scheduled)
                assert generated[0] == ("guard", -1)
                waits = [e for e in generated if e[0] == "wait"]
                assert waits, (job, kind)


def test_gloo_graphs_keep_one_collective_in_flight():
    """On gloo every graph waits each collective before issuing the next (several in flight
    corrupt gloo's heap: bench/repros/gloo_reduce_scatter_race.py); compute still overlaps the
    one in flight."""
    graphs_read = {
        "eager": [("gpt/sgd/c", "forward"), ("gpt/sgd/c", "backward")],
        "inductor": INDUCTOR_GRAPHS,  # the mlp job asks for prefetch_depth=2: gloo still caps it
    }
    for codegen, read in graphs_read.items():
        for per_rank in results(2, codegen):
            for job, kind in read:
                graphs = per_rank[job]["graphs"][kind]
                events = graphs["generated_events" if codegen == "inductor" else "scheduled_events"]
                assert events, (codegen, job, kind)
                for sequence in events:
                    assert most_in_flight(sequence) == 1, (codegen, job, kind, sequence)
    report = results(2, "inductor")[0]["gpt/sgd/c"]["graphs"]["backward"]["inductor_gathers"]
    assert sum(g["overlapped"] for g in report) >= len(report) - 1, report


@pytest.mark.parametrize("serial", [True, False, "auto"])
def test_serial_collectives_option_decides_how_many_are_in_flight(fake_pg, serial):
    """The ``fake`` group is not gloo: "auto" leaves its backward graph with a reduce-scatter
    and the next all-gather in flight together, True serializes it."""
    model = z3.shard(GPT(GPTConfig(n_layer=3)))
    options = {"codegen": "eager", "serial_collectives": serial}
    step = torch.compile(model, backend="zero3", options=options)
    with record_graphs() as records:
        step(gpt_batch(2)[0]).sum().backward()
    (backward,) = [r for r in records if r.kind == "backward"]
    events = scheduled_events(backward.gm.graph)
    assert sum(kind == "issue" for kind, _ in events) > 2
    assert most_in_flight(events) == (1 if serial is True else 2), events


@pytest.mark.parametrize(
    "options",
    [{"weight_quantization": "int8"}, {"gradient_quantization": "int4"}],
    ids=["qwz", "qgz"],
)
def test_quantized_collectives_are_serialized_as_well(fake_pg, options):
    """qwZ's gathers of int8 payloads and qgZ's all-to-alls are collectives to the
    serialization too: one in flight in every graph with it, more without (gloo's heap)."""
    most = {}
    for serial in (True, False):
        torch._dynamo.reset()  # four compiles of one forward: dynamo's recompile limit is shared
        options_of = {"codegen": "eager", "serial_collectives": serial, **options}
        step = torch.compile(z3.shard(GPT(GPTConfig(n_layer=3))), backend="zero3",
                             options=options_of)  # fmt: skip
        with record_graphs() as records:
            step(gpt_batch(2)[0]).sum().backward()
        events = {r.kind: scheduled_events(r.gm.graph) for r in records}
        most[serial] = {kind: most_in_flight(e) for kind, e in events.items()}
        if "gradient_quantization" in options:
            (backward,) = [r for r in records if r.kind == "backward"]
            targets = [n.target for n in backward.gm.graph.nodes]
            assert ALL_TO_ALL in targets and REDUCE_SCATTER not in targets
    torch._dynamo.reset()  # the tests after compile GPT's forward afresh
    assert most[True] == {"forward": 1, "backward": 1}, most
    assert max(most[False].values()) == 2, most


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
        _, readers = gathered_values(wait)
        last = max(pos[u] for u in readers)
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
