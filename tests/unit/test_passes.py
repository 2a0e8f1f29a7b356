"""Unit tests of each pass on small hand-built graphs (fake process group, no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import zero3_compile  # noqa: F401  (registers the zero3:: ops)
from zero3_compile._torch.c10d import ALL_GATHER, REDUCE_SCATTER, WAIT
from zero3_compile.collectives.copy_ops import (
    GATHER_COPY_IN,
    GATHER_COPY_OUT,
    REDUCE_COPY_IN,
    REDUCE_COPY_OUT,
)
from zero3_compile.collectives.ops import REDUCE_GRAD, UNSHARD
from zero3_compile.compiler.context import PassContext, block_of
from zero3_compile.compiler.markers import UnshardCall
from zero3_compile.compiler.node_keys import BUCKET, PARAM_DERIVED
from zero3_compile.compiler.options import Options
from zero3_compile.compiler.passes import (
    assign_buckets,
    dedupe_gathers,
    lower_gathers,
    lower_reductions,
    prefetch_gathers,
    tag_recompute,
    verify,
)
from zero3_compile.compiler.passes.verify import ScheduleError
from zero3_compile.sharding.spec import ShardSpec

WORLD = 4
aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("fake_pg")


def _group() -> str:
    import torch.distributed as dist

    return dist.group.WORLD.group_name


_IDS: dict[str, int] = {}


def spec(shape, name, dtype=None) -> ShardSpec:
    return ShardSpec(
        fqn=name, shape=tuple(shape), group=_group(), world_size=WORLD, param_dtype=dtype
    )


def param_id(name: str) -> int:
    return _IDS.setdefault(name, len(_IDS) + 1)


def gather(shard, shape, name, dtype=None):
    return UNSHARD(shard, param_id(name), spec(shape, name, dtype).literal())


def reduce(grad, shard_shape, name):
    full_shape = (shard_shape[0] * WORLD, *shard_shape[1:])
    return REDUCE_GRAD(
        grad, param_id(name), spec(full_shape, name).literal(), list(shard_shape), torch.float32
    )


def trace(fn, *args) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def plan(kind="forward", **options) -> PassContext:
    return PassContext(options=Options(codegen="eager", **options), graph_kind=kind)


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def position(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def layers_graph(n_layers=3, d=8, root_head=False) -> fx.GraphModule:
    """x -> relu(addmm(b_i, x, t(w_i))) for each layer i; parameters h.{i}.fc.{weight,bias}."""

    def fn(x, *shards):
        for i in range(n_layers):
            w = gather(shards[2 * i], (d, d), f"h.{i}.fc.weight")
            b = gather(shards[2 * i + 1], (d,), f"h.{i}.fc.bias")
            x = torch.relu(torch.addmm(b, x, w.t()))
        if root_head:
            x = x @ gather(shards[-1], (d, d), "head.weight").t()
        return x

    shards = [
        t for _ in range(n_layers) for t in (torch.randn(d // WORLD, d), torch.randn(d // WORLD))
    ]
    if root_head:
        shards.append(torch.randn(d // WORLD, d))
    return trace(fn, torch.randn(4, d), *shards)


def run(gm, plan_, *passes):
    for graph_pass in passes:
        graph_pass(gm, plan_)
        gm.recompile()
    return gm


# ------------------------------------------------------------------------------------ joint passes


def test_dedupe_merges_gathers_of_the_same_shard():
    def fn(idx, shard):
        emb = gather(shard, (8, 4), "wte.weight")[idx]
        return emb @ gather(shard, (8, 4), "wte.weight").t()  # tied head

    gm = trace(fn, torch.randint(0, 8, (3,)), torch.randn(2, 4))
    assert len(calls(gm, UNSHARD)) == 2
    run(gm, plan("joint"), dedupe_gathers)
    assert len(calls(gm, UNSHARD)) == 1
    (marker,) = calls(gm, UNSHARD)
    assert len(marker.users) == 2  # the embedding lookup and the head's transpose


def test_tag_recompute_tags_gathers_and_parameter_only_nodes():
    gm = layers_graph(n_layers=1)
    run(gm, plan("joint"), tag_recompute)
    (weight, bias) = calls(gm, UNSHARD)
    (transpose,) = calls(gm, aten.t.default)
    (addmm,) = calls(gm, aten.addmm.default)
    for node in (weight, bias, transpose):
        assert node.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        assert node.meta[PARAM_DERIVED]
    assert "recompute" not in addmm.meta  # depends on the activation: the partitioner decides


def test_tag_recompute_saves_gathers_when_not_resharding():
    gm = layers_graph(n_layers=1)
    run(gm, plan("joint", reshard_after_forward=False), tag_recompute)
    for marker in calls(gm, UNSHARD):
        assert marker.meta["recompute"] == CheckpointPolicy.MUST_SAVE


# ------------------------------------------------------------------------------------ bucketing


def test_block_of_names_the_repeated_block():
    assert block_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert block_of("layers.0.weight") == "layers.0"
    assert block_of("transformer.wte.weight") == ""
    assert block_of("weight") == ""


def test_buckets_follow_blocks_and_first_use():
    gm = layers_graph(n_layers=3, root_head=True)
    run(gm, plan(), assign_buckets)
    buckets = {UnshardCall.of(n).spec.fqn: n.meta[BUCKET] for n in calls(gm, UNSHARD)}
    assert buckets == {
        "h.0.fc.weight": 0,
        "h.0.fc.bias": 0,
        "h.1.fc.weight": 1,
        "h.1.fc.bias": 1,
        "h.2.fc.weight": 2,
        "h.2.fc.bias": 2,
        "head.weight": 2,  # a root parameter joins the bucket in use
    }


def test_buckets_respect_the_size_cap():
    gm = layers_graph(n_layers=2)
    # a weight gathers 8*8 fp32 = 256 B, a bias 32 B: a 300 B cap fits one weight and one bias
    run(gm, plan(bucket_mb=300 / 2**20), assign_buckets)
    assert [n.meta[BUCKET] for n in calls(gm, UNSHARD)] == [0, 0, 1, 1]
    gm = layers_graph(n_layers=2)
    run(gm, plan(bucket_mb=200 / 2**20), assign_buckets)  # a weight alone exceeds it
    assert [n.meta[BUCKET] for n in calls(gm, UNSHARD)] == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------ lowering


def test_lower_single_parameter_gather_is_a_view_of_the_collective():
    def fn(x, shard):
        return x @ gather(shard, (10, 6), "w").t()  # 10 rows over 4 ranks: 3,3,3,1 (padded to 3)

    gm = trace(fn, torch.randn(2, 6), torch.randn(3, 6))
    run(gm, plan(), assign_buckets, lower_gathers)
    assert not calls(gm, UNSHARD)
    (ag,) = calls(gm, ALL_GATHER)
    assert ag.args[1] == WORLD
    assert ag.meta["val"].shape == (WORLD * 3 * 6,)
    (wait,) = ag.users
    assert wait.target is WAIT
    # the shard (3 rows, no padding, no cast) is the collective's input as it is, and the full
    # weight is a view of the gathered rows, first 10 rows: no copy on either side
    assert not calls(gm, GATHER_COPY_IN) and not calls(gm, GATHER_COPY_OUT)
    assert ag.args[0].op == "placeholder" or ag.args[0].target is aten.view.default
    (rows,) = calls(gm, aten.slice.Tensor)
    assert rows.meta["val"].shape == (10, 6)
    verify(gm, plan(), lowered=True)


def test_lower_bucket_gathers_once_and_copies_out_each_parameter():
    gm = layers_graph(n_layers=1)
    run(gm, plan(), assign_buckets, lower_gathers)
    (ag,) = calls(gm, ALL_GATHER)
    assert ag.meta["val"].shape == (WORLD * (2 * 8 + 2),)  # both shards, one collective
    (copy_in,) = calls(gm, GATHER_COPY_IN)  # one copy-in of both shards, padded
    assert copy_in.args[1] == [16, 2] and ag.args[0] is copy_in
    (copy_out,) = calls(gm, GATHER_COPY_OUT)  # one copy-out, a (world, size) part per parameter
    assert copy_out.args[0] is next(iter(ag.users)) and copy_out.args[1:] == (WORLD, [16, 2])
    parts = [tuple(p.shape) for p in copy_out.meta["val"]]
    assert parts == [(WORLD, 16), (WORLD, 2)]
    # issued right before the first use
    order = position(gm)
    (addmm,) = calls(gm, aten.addmm.default)
    assert order[ag] < order[addmm]
    verify(gm, plan(), lowered=True)


def test_fused_copies_splice_the_arithmetic_as_aten_ops():
    gm = layers_graph(n_layers=1)
    run(gm, plan(fused_copies=True), assign_buckets, lower_gathers)
    (ag,) = calls(gm, ALL_GATHER)
    assert not calls(gm, GATHER_COPY_IN) and not calls(gm, GATHER_COPY_OUT)
    assert ag.args[0].target is aten.cat.default  # for Inductor to fuse
    clones = calls(gm, aten.clone.default)
    assert sorted(tuple(c.meta["val"].shape) for c in clones) == [(WORLD, 2), (WORLD, 16)]
    verify(gm, plan(fused_copies=True), lowered=True)
    gm = backward_graph(n_layers=1)
    run(gm, plan("backward", fused_copies=True), assign_buckets, lower_reductions)
    (rs,) = calls(gm, REDUCE_SCATTER)
    assert not calls(gm, REDUCE_COPY_IN) and not calls(gm, REDUCE_COPY_OUT)
    (cat,) = calls(gm, aten.cat.default)
    assert cat.args[1] == 1 and cat.meta["val"].shape == (WORLD, 18)  # (world, bucket_numel)
    assert len(calls(gm, aten.div.Tensor)) == 2  # the mean, per member


def test_lower_casts_shards_before_the_gather():
    def fn(x, shard):
        return x @ gather(shard, (8, 8), "w", dtype=torch.bfloat16).t()

    gm = trace(fn, torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8))
    run(gm, plan(), assign_buckets, lower_gathers)
    (ag,) = calls(gm, ALL_GATHER)
    assert ag.args[0].meta["val"].dtype == torch.bfloat16  # half the bytes on the wire
    assert ag.args[0].meta["val"].numel() == 16  # the shard, not the full weight


# ------------------------------------------------------------------------------------ prefetch


def _layer_order(gm):
    order = position(gm)
    ags = sorted(calls(gm, ALL_GATHER), key=order.__getitem__)
    waits = [next(iter(ag.users)) for ag in ags]
    mms = sorted(calls(gm, aten.addmm.default), key=order.__getitem__)
    return order, ags, waits, mms


def test_prefetch_depth_one_issues_next_gather_before_current_layer():
    """prefetch_depth=1, one bucket per layer:

    ag0 wait0 | ag1 | addmm0 | wait1 | ag2 | addmm1 | wait2 | addmm2
    """
    gm = layers_graph(n_layers=3)
    run(gm, plan(prefetch_depth=1), assign_buckets, lower_gathers, prefetch_gathers)
    order, ags, waits, mms = _layer_order(gm)
    assert len(ags) == 3
    for k in range(2):
        assert (
            order[ags[k + 1]] < order[mms[k]]
        )  # layer k+1's gather issued before layer k computes
        assert order[waits[k + 1]] > order[mms[k]]  # and waited after it
        assert order[ags[k + 1]] > order[waits[k]]  # at most one gather ahead
    verify(gm, plan(), lowered=True)


def test_prefetch_depth_two_keeps_two_gathers_ahead():
    gm = layers_graph(n_layers=4)
    run(gm, plan(prefetch_depth=2), assign_buckets, lower_gathers, prefetch_gathers)
    order, ags, waits, mms = _layer_order(gm)
    assert order[ags[2]] < order[mms[0]] and order[ags[2]] < order[waits[1]]
    assert order[ags[3]] > order[waits[1]] and order[ags[3]] < order[mms[1]]


def test_prefetch_depth_zero_gathers_right_before_use():
    """prefetch_depth=0: each all-gather is issued right before its own wait, with no compute in
    between, after the previous layer's compute."""
    gm = layers_graph(n_layers=3)
    run(gm, plan(prefetch_depth=0), assign_buckets, lower_gathers, prefetch_gathers)
    order, ags, waits, mms = _layer_order(gm)
    nodes = list(gm.graph.nodes)
    for k in range(3):
        between = nodes[order[ags[k]] + 1 : order[waits[k]]]
        assert between == [], f"nodes between gather {k} and its wait: {between}"
        if k:
            assert order[ags[k]] > order[mms[k - 1]]


def test_max_inflight_bytes_delays_prefetch():
    # each layer's bucket gathers (64 + 8) * 4 B = 288 B; allow only one bucket in flight
    gm = layers_graph(n_layers=4)
    run(
        gm,
        plan(prefetch_depth=3, max_inflight_bytes=300),
        assign_buckets,
        lower_gathers,
        prefetch_gathers,
    )
    order, ags, waits, mms = _layer_order(gm)
    for k in range(1, 4):
        assert order[ags[k]] > order[waits[k - 1]]  # never two buckets in flight
        assert order[ags[k]] < order[mms[k - 1]]  # but still one ahead


# ------------------------------------------------------------------------------------ reductions


def backward_graph(n_layers=3, d=8):
    """Gradients produced last layer first, each followed by its reduce_grad marker."""

    def fn(*grads_in):
        outs = []
        for i in reversed(range(n_layers)):
            g_w = grads_in[i] * 2.0
            g_b = g_w.sum(0)
            outs.append(reduce(g_w, (d // WORLD, d), f"h.{i}.fc.weight"))
            outs.append(reduce(g_b, (d // WORLD,), f"h.{i}.fc.bias"))
        return outs

    return trace(fn, *[torch.randn(d, d) for _ in range(n_layers)])


def test_reduce_scatters_issue_when_bucket_ready_and_wait_one_behind():
    gm = backward_graph(n_layers=3)
    run(gm, plan("backward", reduce_scatter_depth=1), assign_buckets, lower_reductions)
    assert not calls(gm, REDUCE_GRAD)
    order = position(gm)
    rss = sorted(calls(gm, REDUCE_SCATTER), key=order.__getitem__)
    assert len(rss) == 3  # one per layer (bucket)
    sums = sorted(calls(gm, aten.sum.dim_IntList), key=order.__getitem__)
    waits = [next(iter(rs.users)) for rs in rss]
    for k in range(3):
        assert order[rss[k]] > order[sums[k]]  # after its last gradient...
        if k + 1 < 3:
            assert order[rss[k]] < order[sums[k + 1]]  # ...as soon as it is ready
            assert order[waits[k]] < order[rss[k + 1]]  # at most one in flight
    copy_outs = calls(gm, REDUCE_COPY_OUT)
    assert len(copy_outs) == 3 and all(c.args[3] == WORLD for c in copy_outs)  # the mean
    for c, wait in zip(sorted(copy_outs, key=order.__getitem__), waits):
        assert c.args[0] is wait and c.args[1:3] == ([16, 2], [16, 2])  # the whole shard each
    verify(gm, plan("backward"), lowered=True)


def test_reduce_scatter_depth_two_defers_waits():
    gm = backward_graph(n_layers=3)
    run(gm, plan("backward", reduce_scatter_depth=2), assign_buckets, lower_reductions)
    order = position(gm)
    rss = sorted(calls(gm, REDUCE_SCATTER), key=order.__getitem__)
    waits = [next(iter(rs.users)) for rs in rss]
    assert order[waits[0]] > order[rss[1]] and order[waits[0]] < order[rss[2]]


def test_reduce_bucket_packs_gradients_in_rank_major_layout():
    gm = backward_graph(n_layers=1)
    run(gm, plan("backward"), assign_buckets, lower_reductions)
    (rs,) = calls(gm, REDUCE_SCATTER)
    assert rs.args[1] == "sum"
    assert rs.args[0].meta["val"].shape == (WORLD * (16 + 2),)
    (copy_in,) = calls(gm, REDUCE_COPY_IN)  # both gradients, each padded to world * size
    assert rs.args[0] is copy_in and copy_in.args[1:] == (WORLD, [16, 2], torch.float32)
    # the layout's arithmetic itself: tests/unit/test_arithmetic.py


# ------------------------------------------------------------------------------------ verifier


def test_verifier_rejects_a_collective_read_before_its_wait():
    gm = layers_graph(n_layers=1)
    run(gm, plan(), assign_buckets, lower_gathers)
    (ag,) = calls(gm, ALL_GATHER)
    with gm.graph.inserting_after(ag):
        gm.graph.call_function(aten.clone.default, (ag,))
    with pytest.raises(ScheduleError, match="exactly one user"):
        verify(gm, plan())


def test_verifier_rejects_a_marker_left_after_lowering():
    gm = layers_graph(n_layers=1)
    with pytest.raises(ScheduleError, match="survived lowering"):
        verify(gm, plan(), lowered=True)


def test_passes_leave_a_graph_without_markers_unchanged():
    gm = trace(lambda x, w: torch.relu(x @ w), torch.randn(2, 3), torch.randn(3, 3))
    before = gm.code
    run(gm, plan("backward"), dedupe_gathers, tag_recompute, assign_buckets, lower_gathers)
    run(gm, plan("backward"), prefetch_gathers, lower_reductions)
    assert gm.code == before
