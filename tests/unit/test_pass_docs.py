"""The before/after pictures in the passes' docstrings are what the passes really do: each is
the ``picture()`` of a small example graph before and after the pass (no drift)."""

from __future__ import annotations

import pytest
import torch

import zero3_compile  # noqa: F401  (registers the zero3:: ops)
from zero3_compile.compiler.passes import (
    assign_buckets,
    dedupe_gathers,
    handoff_gathers,
    insert_guard,
    lower_gathers,
    lower_reductions,
    prefetch_gathers,
    serialize_collectives,
    tag_recompute,
)

from ..support.golden import docstring_block, picture
from .test_passes import WORLD, gather, layers_graph, plan, reduce, run, trace

pytestmark = pytest.mark.usefixtures("fake_pg")


def tied_graph():
    def fn(idx, shard):
        emb = gather(shard, (8, 4), "wte.weight")[idx]
        return emb @ gather(shard, (8, 4), "wte.weight").t()

    return trace(fn, torch.randint(0, 8, (3,)), torch.randn(8 // WORLD, 4))


def chain_graph(n_layers=2, d=4):
    """x -> x @ t(w_i) for each layer; one (d, d) parameter h.{i}.w per layer."""

    def fn(x, *shards):
        for i in range(n_layers):
            x = x @ gather(shards[i], (d, d), f"h.{i}.w").t()
        return x

    return trace(fn, torch.randn(2, d), *[torch.randn(d // WORLD, d) for _ in range(n_layers)])


def backward_chain(n_layers=2, d=4):
    """Gradients produced last layer first, each followed by its reduce_grad marker."""

    def fn(*grads):
        return [
            reduce(grads[i] * 2.0, (d // WORLD, d), f"h.{i}.w") for i in reversed(range(n_layers))
        ]

    return trace(fn, *[torch.randn(d, d) for _ in range(n_layers)])


def examples():
    """(pass, build the example graph, passes run before it, picture options)."""
    return [
        (dedupe_gathers, tied_graph, (), "joint", {}),
        (tag_recompute, lambda: layers_graph(n_layers=1), (), "joint", {"tags": True}),
        (
            assign_buckets,
            lambda: layers_graph(n_layers=2, root_head=True),
            (),
            "forward",
            {"buckets": True},
        ),
        (lower_gathers, lambda: layers_graph(n_layers=1), (assign_buckets,), "forward", {}),
        (prefetch_gathers, chain_graph, (assign_buckets, lower_gathers), "forward", {}),
        (lower_reductions, backward_chain, (assign_buckets,), "backward", {}),
        (insert_guard, lambda: chain_graph(1), (assign_buckets, lower_gathers), "forward", {}),
        (
            serialize_collectives,
            chain_graph,
            (assign_buckets, lower_gathers, prefetch_gathers),
            "forward",
            {},
        ),
        (
            handoff_gathers,
            lambda: chain_graph(1),
            (assign_buckets, lower_gathers, prefetch_gathers),
            "forward",
            {},
        ),
    ]


# options of the plan an example runs under (default: the defaults)
PLAN_OPTIONS = {
    serialize_collectives: {"prefetch_depth": 2, "serial_collectives": True},
    handoff_gathers: {"cross_graph_prefetch": True},
}


def example_plan(graph_pass, kind):
    return plan(kind, **PLAN_OPTIONS.get(graph_pass, {}))


@pytest.mark.parametrize("index", range(9), ids=[e[0].__name__ for e in examples()])
def test_docstring_pictures_are_what_the_pass_does(index):
    graph_pass, build, before_passes, kind, options = examples()[index]
    gm = build()
    run(gm, example_plan(graph_pass, kind), *before_passes)
    before = picture(gm, **options)
    run(gm, example_plan(graph_pass, kind), graph_pass)
    after = picture(gm, **options)
    assert docstring_block(graph_pass, "before") == before, f"before:\n{before}"
    assert docstring_block(graph_pass, "after") == after, f"after:\n{after}"


def test_the_pipeline_declares_every_stage_in_order_each_pass_with_its_invariant():
    """``compiler/pipeline.py``'s one list: every compile stage from the dynamo graph to the
    generated code, each pass of the one signature stating its invariant."""
    from zero3_compile.compiler.pipeline import PIPELINE, describe_pipeline, passes_for

    assert [(s.name, s.graph) for s in PIPELINE] == [
        ("pre-dynamo", "dynamo"),
        ("dynamo", "dynamo"),
        ("joint", "joint"),
        ("memory budget", "joint"),
        ("partition", "joint"),
        ("forward", "forward"),
        ("backward", "backward"),
        ("post-codegen", "generated"),
    ]
    assert [p.__name__ for p in passes_for("joint")][-6:] == [
        "plan_memory_budget",
        "min_cut_partition",
        "order_saved_values",
        "save_waited",
        "check_no_gathered_saved",
        "keep_secondary_shards",
    ]
    assert passes_for("inference") == passes_for("forward")
    text = describe_pipeline()
    for stage in PIPELINE:
        assert f"{stage.name} ({stage.graph} graph)" in text
        for graph_pass in stage.passes:
            assert "**Invariant**" in (graph_pass.__doc__ or ""), graph_pass.__name__
            assert f"  {graph_pass.__name__}: " in text


if __name__ == "__main__":  # print the pictures, to paste into the docstrings
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    for graph_pass, build, before_passes, kind, options in examples():
        gm = build()
        run(gm, example_plan(graph_pass, kind), *before_passes)
        print(f"===== {graph_pass.__name__}\nbefore:\n{picture(gm, **options)}")
        run(gm, example_plan(graph_pass, kind), graph_pass)
        print(f"after:\n{picture(gm, **options)}\n")
