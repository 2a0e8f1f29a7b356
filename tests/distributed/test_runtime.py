"""Each sharded model owns its runtime: two models in one process keep their own timeouts and
optimizer hooks; sharding over one of several disjoint groups (or a sub-mesh) needs no other rank
and trains like eager; the marker contract and the module type (no processes)."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero3_compile as z3
from zero3_compile.collectives.ops import GUARD, UNSHARD
from zero3_compile.compiler.node_keys import ROLE, ROLE_REDUCE_SCATTER
from zero3_compile.compiler.recording import record_graphs
from zero3_compile.sharding.spec import SPEC_VERSION, ShardSpec
from zero3_compile.sharding.state import ShardState, state_of

from ..support.dist_utils import run_ranks, run_scenarios
from ..support.models import GPT, FrozenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from ..support.training import rel_diff

EAGER = {"codegen": "eager"}


def _two_models(rank, world_size):
    torch._dynamo.reset()
    torch.manual_seed(0)
    a = z3.shard(GPT(), sync_timeout_s=7)
    b = z3.shard(FrozenMLP(), sync_timeout_s=300)
    out = {
        "distinct": a.zero3_runtime is not b.zero3_runtime,
        "timeouts": [a.zero3_runtime.timeout_s, b.zero3_runtime.timeout_s],
    }
    compiled_a = torch.compile(a, backend="zero3", options=EAGER)
    compiled_b = torch.compile(b, backend="zero3", options=EAGER)
    batch_a, batch_b = gpt_batch(2, seed=rank), mlp_batch(2, seed=rank)
    with record_graphs() as records:
        gpt_loss(compiled_a, batch_a).backward()
        mlp_loss(compiled_b, batch_b).backward()
    # each graph's guard carries the timeout of the model whose parameters it gathers
    out["graph_timeouts"] = sorted(
        {n.args[-1] for r in records for n in r.gm.graph.nodes if n.target is GUARD}
    )
    out["reductions"] = sorted(
        {
            str(n.target)
            for r in records
            for n in r.gm.graph.nodes
            if n.meta.get(ROLE) == ROLE_REDUCE_SCATTER
        }
    )

    # optimizer hooks go to the optimizers of the model that needs them, nowhere else
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD([p for p in b.parameters() if p.requires_grad], lr=0.1)
    opt_plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    for opt in (opt_a, opt_b):
        opt.zero_grad()
    z3.set_requires_gradient_sync(a, False)
    gpt_loss(compiled_a, batch_a).backward()  # a's gradients pending unreduced
    mlp_loss(compiled_b, batch_b).backward()
    opt_b.step()  # b has nothing pending: steps
    opt_plain.step()
    try:
        opt_a.step()
        out["a_refused"] = None
    except RuntimeError as error:
        out["a_refused"] = str(error)
    out["hooks"] = [len(o._optimizer_step_pre_hooks) for o in (opt_a, opt_b, opt_plain)]
    z3.set_requires_gradient_sync(a, True)
    gpt_loss(compiled_a, batch_a).backward()  # reduces the pending gradients too
    opt_a.step()

    # an eager gather of a, which only rank 0 runs: named within a's timeout, not b's
    dist.barrier()
    seconds = None
    if rank == 0:
        start = time.monotonic()
        try:
            a(batch_a[0])
        except z3.CollectiveMismatchError:
            seconds = time.monotonic() - start
    else:
        time.sleep(12)
    out["eager_timeout_s"] = seconds
    return out


@functools.cache
def two_models():
    return run_ranks(_two_models, 2, timeout=400)


def test_two_models_keep_their_own_timeouts():
    for out in two_models():
        assert out["distinct"]
        assert out["timeouts"] == [7.0, 300.0]
        assert out["graph_timeouts"] == [7.0, 300.0]
    seconds = two_models()[0]["eager_timeout_s"]
    assert seconds is not None and 6.0 < seconds < 60.0, seconds


def test_gloo_reductions_are_in_place_all_reduces():
    """On gloo a gradient reduction is an all-reduce in place on the copy-in's buffer (gloo's
    reduce-scatter would all-reduce a copy of it: schemes.gloo_reduce_scatter_as_all_reduce);
    the values are checked by every equivalence test."""
    for out in two_models():
        assert out["reductions"] == ["_c10d_functional.all_reduce_.default"]


def _lone_reduction(rank, world):
    """A bf16 gradient of one parameter reduced in fp32 on gloo, under the profiler."""
    from zero3_compile.collectives import schemes
    from zero3_compile.inspect import measure_peak_bytes
    from zero3_compile.sharding.spec import spec_of_shape

    group = dist.group.WORLD.group_name
    spec = spec_of_shape((8192, 64), world, group=group)
    torch.manual_seed(rank)
    grad = torch.randint(-8, 8, (8192, 64)).to(torch.bfloat16)
    scheme = schemes.reduce_scheme(spec, torch.float32, torch.float32)
    shapes = [(8192 // world, 64)]
    (shard,) = schemes.run_reduce(scheme, schemes.EAGER, [grad], [spec], shapes)
    (peak, _) = measure_peak_bytes(
        lambda: schemes.run_reduce(scheme, schemes.EAGER, [grad], [spec], shapes)
    )
    grads = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(grads, grad)
    want = (sum(g.float() for g in grads) / world).chunk(world)[rank]
    return {
        "exact": torch.equal(shard.view(want.shape), want),
        "peak": peak,
        "full": grad.numel() * 4,
    }


def test_a_gloo_reduction_holds_one_full_copy_of_the_gradient():
    """Cast to fp32 (one full-size buffer), summed in place, this rank's rows divided out: not
    cast, concatenated and copied again by gloo's reduce-scatter (three full-size buffers)."""
    for out in run_ranks(_lone_reduction, 2, timeout=120):
        assert out["exact"]
        assert out["full"] <= out["peak"] < 1.6 * out["full"], out


def test_optimizer_hooks_only_on_the_models_optimizers():
    for out in two_models():
        assert out["a_refused"] is not None and "set_requires_gradient_sync" in out["a_refused"]
        assert out["hooks"] == [1, 1, 0]


def _train(model, batches, rows, compiled, group=None, steps=3):
    # SGD: Adam's normalisation turns rounding noise on zero gradients (attention key biases)
    # into full-size steps
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        idx, targets = batches[step]
        loss = gpt_loss(compiled, (idx[rows], targets[rows]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if group is not None:  # the pair's mean: the loss of the whole batch
            dist.all_reduce(value, group=group)
            value /= dist.get_world_size(group)
        losses.append(value.item())
    return losses


def _subgroups(rank, world_size, how):
    """Two data-parallel pairs, {0, 1} and {2, 3}; each pair shards over its own group."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    pair = rank // 2
    if how == "group":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
        kwargs = {"group": groups[pair]}
        if pair == 0:  # the pairs' processes now differ in what they created before shard()
            z3.shard(nn.Linear(4, 4), group=groups[pair], sync_timeout_s=60)
    else:  # a (pipeline, data) mesh: shard over this stage's data-parallel sub-mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        kwargs = {"mesh": mesh["dp"]}
    batches = [gpt_batch(4, seed=10 * pair + step) for step in range(3)]
    torch.manual_seed(0)
    model = z3.shard(GPT(), sync_timeout_s=60, **kwargs)
    rows = slice(2 * (rank % 2), 2 * (rank % 2) + 2)
    compiled = torch.compile(model, backend="zero3", options=EAGER)
    losses = _train(model, batches, rows, compiled, model.zero3_runtime.dp.shard_group)
    torch.manual_seed(0)
    reference = GPT()
    reference_losses = _train(reference, batches, slice(0, 4), reference)
    full = z3.full_state_dict(model)
    return {
        "world": model.zero3_runtime.world_size,
        "loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses)),
        "param_error": max(rel_diff(full[k], v) for k, v in reference.state_dict().items()),
    }


@functools.cache
def _subgroup_runs():
    return run_scenarios(_subgroups, 4, [("group",), ("submesh",)], timeout=600)


@pytest.mark.parametrize("how", ["group", "submesh"])
def test_sharding_over_one_of_several_groups_trains_like_eager(how):
    for out in _subgroup_runs()[(how,)]:
        assert out["world"] == 2
        assert out["loss_error"] < 1e-5
        assert out["param_error"] < 1e-5


# ------------------------------------------------------------------------ no processes


def test_marker_ops_take_shard_id_and_spec():
    """A new spec field never changes an op schema: the fields travel inside the literal."""
    assert str(UNSHARD._schema) == (
        "zero3::unshard(Tensor shard, int param_id, str spec, Tensor? grad_sink=None) -> Tensor"
    )
    spec = ShardSpec("h.0.w", (10, 3), "0", 4, "1", 2, torch.bfloat16, torch.float32, True)
    literal = spec.literal()
    assert f'"v":{SPEC_VERSION}' in literal
    assert ShardSpec.parse(literal) == spec
    assert ShardSpec.parse(literal) is ShardSpec.parse(literal)  # parsed once
    with pytest.raises(ValueError, match="version"):
        ShardSpec.parse(literal.replace(f'"v":{SPEC_VERSION}', '"v":999'))


def test_spec_rows_are_torch_chunk_rows():
    full = torch.arange(10 * 3).reshape(10, 3)
    spec = ShardSpec("w", (10, 3), "0", 4)
    assert [spec.rows(r) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    for rank, chunk in enumerate(torch.chunk(full, 4)):
        assert torch.equal(spec.chunk(full, rank), chunk)
    assert ShardSpec("w", (2, 3), "0", 4).rows(3) == (2, 0)  # trailing ranks hold nothing


@pytest.mark.usefixtures("fake_pg")
def test_sharded_modules_are_zero3_modules_with_their_methods():
    model = z3.shard(FrozenMLP())
    assert all(isinstance(m, z3.Zero3Module) for m in model.modules())
    assert type(model.layers[0]).__name__ == "Linear" and isinstance(model.layers[0], nn.Linear)
    spec = model.shard_spec("layers.2.weight")
    assert spec.shape == (13, 17) and spec.world_size == 4
    names = [name for name, _ in model.sharded_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    state = state_of(model.layers[2]._parameters["weight"])
    model.set_requires_gradient_sync(False)
    assert state.state is ShardState.ACCUMULATING
    model.set_requires_gradient_sync(True)
    assert state.state is ShardState.SHARDED
    with pytest.raises(AssertionError, match="keep the full parameter"):
        state.transition(ShardState.KEPT_GATHERED)  # nothing was gathered to keep
    state.kept_full = torch.zeros(state.full_shape)
    state.transition(ShardState.KEPT_GATHERED)
    with pytest.raises(AssertionError, match="cannot go from KEPT_GATHERED to ACCUMULATING"):
        state.transition(ShardState.ACCUMULATING)
