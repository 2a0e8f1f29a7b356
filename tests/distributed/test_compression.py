"""Compressed collectives (ZeRO++'s qwZ and qgZ): the blockwise quantization's bounds, the
quantized schemes' copy-in/copy-out layouts on real tensors (collectives simulated, no process
group), and training on gloo ranks against the uncompressed run and single-process eager, with
the bytes ``explain`` reports."""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch

import zero3_compile as z3
from zero3_compile.collectives import quantize
from zero3_compile.collectives.schemes import (
    EAGER,
    QuantizedAllGather,
    QuantizedHybridReduce,
    QuantizedNodeReduce,
    QuantizedReduceScatter,
    gather_scheme,
    reduce_scheme,
)
from zero3_compile.sharding.spec import spec_of_shape

from ..support.dist_utils import run_scenarios
from ..support.tp_models import TinyLlama, TinyLlamaConfig, llama_batch, llama_loss
from ..support.training import rel_diff, train_pair

SHAPES = [(10, 6), (3,), (5, 2, 3), (40, 8), (1, 7)]  # uneven rows, fewer rows than ranks


def _bound(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """Per element: half a quantization step of its block, ``amax / (2 * levels)``."""
    numel = x.numel()
    padded = torch.nn.functional.pad(x.float(), (0, quantize.padded_numel(numel, block) - numel))
    amax = padded.view(-1, block).abs().amax(dim=1, keepdim=True)
    return (amax / (2 * quantize.LEVELS[bits])).expand(-1, block).reshape(-1)[:numel]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000, 4097])
def test_round_trip_error_is_at_most_half_a_step_of_each_block(bits, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-3, 2, numel)  # blocks of very different scales
    payload = quantize.quantize(x, 64, bits)
    assert payload.dtype == torch.uint8
    assert payload.numel() == quantize.payload_bytes(numel, 64, bits)
    back = quantize.dequantize(payload, numel, 64, bits, torch.float32)
    assert back.shape == x.shape
    assert ((back - x).abs() <= _bound(x, 64, bits) * (1 + 1e-6)).all()
    # the largest element of each block is exact up to float rounding, zeros stay zeros
    assert (
        quantize.dequantize(
            quantize.quantize(torch.zeros(numel), 64, bits), numel, 64, bits, torch.float32
        )
        .eq(0)
        .all()
    )


def test_payload_layout_int4_low_nibble_first_then_scales():
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, 0, 0, 0, 0])  # amax 7: scale 1, integers as they are
    payload = quantize.quantize(x, 8, 4)
    assert payload[:2].tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | ((0 + 8) << 4)]
    assert payload[2:4].tolist() == [8 | (8 << 4)] * 2
    assert payload[4:].clone().view(torch.float32).tolist() == [1.0]
    assert quantize.payload_bytes(8, 8, 4) == 4 + 4
    assert quantize.payload_bytes(1000, 256, 8) == 1024 + 4 * 4  # padded to whole blocks


def test_rows_quantize_independently_and_bf16_comes_back_in_bf16():
    rows = torch.stack([torch.randn(300), 1000 * torch.randn(300)])
    payloads = quantize.quantize_rows(rows, 128, 8)
    assert payloads.shape == (2, quantize.payload_bytes(300, 128, 8))
    back = quantize.dequantize_rows(payloads, 300, 128, 8, torch.float32)
    for row, got in zip(rows, back):
        assert ((got - row).abs() <= _bound(row, 128, 8) * (1 + 1e-6)).all()
    half = quantize.dequantize(
        quantize.quantize(rows[0].bfloat16(), 128, 8), 300, 128, 8, torch.bfloat16
    )
    assert half.dtype == torch.bfloat16
    assert rel_diff(half.float(), rows[0]) < 0.02


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_reproducible_and_within_one_step(bits):
    """Values a third of a step above an integer: to nearest always rounds them down (biased by
    a third of a step); stochastic rounding's mean error is near zero, the same on every call."""
    levels = quantize.LEVELS[bits]
    x = torch.full((2, 8192), 1 / 3)
    x[:, ::64] = levels  # each block's largest magnitude: one step is exactly 1
    others = x != levels
    nearest = quantize.dequantize_rows(
        quantize.quantize_rows(x, 64, bits), 8192, 64, bits, torch.float32
    )
    assert (nearest - x)[others].mean() == pytest.approx(-1 / 3, abs=1e-6)
    payload = quantize.quantize_rows(x, 64, bits, stochastic=True)
    assert torch.equal(payload, quantize.quantize_rows(x.clone(), 64, bits, stochastic=True))
    back = quantize.dequantize_rows(payload, 8192, 64, bits, torch.float32)
    error = (back - x)[others]
    assert abs(error.mean()) < 0.02
    assert error.abs().max() < 1
    assert set(back[others].unique().tolist()) == {0.0, 1.0}  # floor or ceil, nothing else


def test_aligned_rows_start_each_segment_at_a_block_and_come_back():
    rows = torch.randn(3, 5 + 64 + 20)
    aligned = quantize.align_rows(rows, [5, 64, 20], 16)
    assert aligned.shape == (3, quantize.aligned_numel([5, 64, 20], 16)) == (3, 16 + 64 + 32)
    assert torch.equal(aligned[:, :5], rows[:, :5]) and aligned[:, 5:16].eq(0).all()
    assert torch.equal(aligned[:, 16:80], rows[:, 5:69])
    assert torch.equal(quantize.unalign_rows(aligned, [5, 64, 20], 16), rows)
    whole = torch.randn(2, 32)
    assert quantize.align_rows(whole, [16, 16], 16) is whole  # whole blocks: nothing to pad


@pytest.mark.parametrize("bits", [8, 4])
def test_a_small_parameter_beside_a_large_one_keeps_its_own_scale(bits):
    """A norm's gradients (1e-3) in the same bucket as a matrix's (1): each member's part of a
    row starts a new block, so the small one's error is within its own steps, not the matrix's
    (a block shared with the matrix would give it errors of the matrix's step, 1e-1)."""
    world = 2
    shapes = [(6,), (64, 8)]  # 3 elements of the norm per rank, then the matrix's rows
    specs = [spec_of_shape(shape, world) for shape in shapes]
    torch.manual_seed(3)
    grads = [[1e-3 * torch.randn(6), torch.randn(64, 8)] for _ in range(world)]
    scheme = reduce_scheme(
        specs[0], torch.float32, torch.float32, quantization=quantize.Quantization(bits, 16)
    )
    emits = [_Exchange() for _ in range(world)]
    works = [
        scheme.issue(emits[r], 0, scheme.copy_in(EAGER, grads[r], specs), specs)
        for r in range(world)
    ]
    _deliver(emits, all_to_all=True)
    for rank in range(world):
        shapes_r = [_shard(torch.empty(shape), world, rank).shape for shape in shapes]
        waited = scheme.wait(emits[rank], 0, works[rank])
        small, _ = scheme.copy_out(EAGER, waited, specs, shapes_r)
        want = _shard(sum(g[0] for g in grads) / world, world, rank)
        own_step = max(_shard(g[0], world, rank).abs().max() for g in grads) / quantize.LEVELS[bits]
        assert (small - want).abs().max() <= own_step, (small, want)


def _shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, world)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_quantized_gather_gives_every_parameter_within_the_bound(world):
    """copy-in on each rank, the all-gather simulated (the payloads concatenated), copy-out:
    each full parameter within half a step of its own blocks (each member's part of a rank's flat
    bucket starts a new block)."""
    torch.manual_seed(world)
    fulls = [torch.randn(shape) * 10**i for i, shape in enumerate(SHAPES)]  # scales 1 to 1e4
    specs = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    scheme = gather_scheme(specs[0], torch.float32, quantization=quantize.Quantization(8, 32))
    assert isinstance(scheme, QuantizedAllGather) and scheme.compresses
    sizes = [s.padded_numel for s in specs]
    payloads = []
    for rank in range(world):
        shards = [_shard(full, world, rank) for full in fulls]
        (payload,) = scheme.copy_in(EAGER, shards, specs)
        assert payload.dtype == torch.uint8
        aligned = quantize.aligned_numel(sizes, 32)
        assert aligned > sum(sizes)  # members that are not whole blocks were padded
        assert payload.numel() == quantize.payload_bytes(aligned, 32, 8)
        payloads.append(payload)
    fulls_out = scheme.copy_out(EAGER, [torch.cat(payloads)], specs)
    for index, (got, full) in enumerate(zip(fulls_out, fulls)):
        assert got.shape == full.shape
        for rank in range(world):
            mine = _shard(full, world, rank).reshape(-1)
            rows = _shard(got, world, rank).reshape(-1)
            bound = _bound(mine, 32, 8)  # this member's blocks alone
            assert ((rows - mine).abs() <= bound * (1 + 1e-6)).all(), (index, rank)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_quantized_reduction_gives_each_rank_the_mean_of_its_rows_within_the_bound(bits, world):
    """copy-in on each rank, the all-to-all simulated (rank r receives every rank's row r),
    copy-out: rank r's gradient shards are the mean over ranks within the sum of the ranks'
    steps, divided by N."""
    torch.manual_seed(bits * world)
    specs = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    grads = [[torch.randn(shape) for shape in SHAPES] for _ in range(world)]  # rank -> grads
    scheme = reduce_scheme(
        specs[0], torch.float32, torch.float32, quantization=quantize.Quantization(bits, 16)
    )
    assert isinstance(scheme, QuantizedReduceScatter) and scheme.compresses
    rows = [scheme.copy_in(EAGER, grads[r], specs)[0].view(world, -1) for r in range(world)]
    mean = [sum(g[i] for g in grads) / world for i in range(len(SHAPES))]
    for rank in range(world):
        received = torch.cat([rows[sender][rank] for sender in range(world)])
        shapes = [_shard(m, world, rank).shape for m in mean]
        shards = scheme.copy_out(EAGER, [received], specs, shapes)
        # each sender's error is below one step of its block (stochastic rounding); a block of
        # the flat row may span parameters: its largest magnitude is at most any gradient's
        step = max(g.abs().max() for rank_grads in grads for g in rank_grads)
        step = step / quantize.LEVELS[bits]
        for i, (got, want) in enumerate(zip(shards, mean)):
            expected = _shard(want, world, rank)
            assert got.shape == expected.shape
            if expected.numel():
                assert (got - expected).abs().max() <= step * (1 + 1e-5), (i, rank)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_the_owners_own_row_is_summed_exactly(bits, world):
    """A rank's own row never crosses the wire: its copy-in keeps it exact beside the payload
    and its copy-out sums it in place of the quantized copy. The others' gradients zero (they
    quantize to exact zeros): each rank's shards are its own gradients / N, to the bit; random
    gradients: within the N - 1 other contributions' steps, divided by N."""
    torch.manual_seed(7 * bits + world)
    specs = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    schemes = [
        QuantizedReduceScatter(
            torch.float32,
            torch.float32,
            world_size=world,
            group="g",
            quantization=quantize.Quantization(bits, 16),
            own_rank=rank,
        )  # fmt: skip
        for rank in range(world)
    ]

    def reduce(grads):  # rank -> its shards, through a simulated all-to-all
        sent = [schemes[r].copy_in(EAGER, grads[r], specs) for r in range(world)]
        assert all(len(payloads) == 2 for payloads in sent)  # the payload and the own row
        emits = [_Exchange() for _ in range(world)]
        works = [schemes[r].issue(emits[r], 0, sent[r], specs) for r in range(world)]
        _deliver(emits, all_to_all=True)
        out = []
        for rank in range(world):
            waited = schemes[rank].wait(emits[rank], 0, works[rank])
            shapes = [_shard(torch.empty(shape), world, rank).shape for shape in SHAPES]
            out.append(schemes[rank].copy_out(EAGER, waited, specs, shapes))
        return out

    for owner in range(world):
        grads = [
            [torch.randn(shape) if r == owner else torch.zeros(shape) for shape in SHAPES]
            for r in range(world)
        ]
        shards = reduce(grads)
        for i in range(len(SHAPES)):
            want = _shard(grads[owner][i] / world, world, owner)
            assert torch.equal(shards[owner][i], want), (owner, i)
    grads = [[torch.randn(shape) for shape in SHAPES] for _ in range(world)]
    step = max(g.abs().max() for rank_grads in grads for g in rank_grads) / quantize.LEVELS[bits]
    for rank, shards in enumerate(reduce(grads)):
        for i, got in enumerate(shards):
            want = _shard(sum(g[i] for g in grads) / world, world, rank)
            assert got.shape == want.shape
            if want.numel():
                error = (got - want).abs().max()
                assert error <= step * (world - 1) / world * (1 + 1e-5), (rank, i)


class _Exchange:
    """An ``Emit`` for one rank of a simulated mesh: a collective records what the rank sends
    and returns this emit; once every member has sent, ``_deliver`` sets what it receives."""

    in_graph = False

    def collective(self, role, group_role, target, payload, *args, full_bytes=None):
        self.sent, self.received = payload, None
        return self

    def wait(self, role, work):
        return work.received

    def traced(self, role, fn, inputs):
        return fn(*inputs)


def _deliver(members: list[_Exchange], all_to_all: bool) -> None:
    n = len(members)
    for k, member in enumerate(members):
        if all_to_all:  # member k receives row k of every member's payload
            member.received = torch.cat([m.sent.view(n, -1)[k] for m in members])
        else:
            member.received = torch.cat([m.sent for m in members])


def _hybrid_reduce(grads: dict, shape, bits: int, keep_own: bool) -> torch.Tensor:
    """The reduced shards of a simulated 2 x 2 mesh (2 replicas of a row of 2; ``grads``: (replica,
    row rank) -> gradient), every collective delivered by hand, in row-rank order; the replicas'
    copies checked identical."""
    world, replicas = 2, 2
    ranks = [(i, r) for i in range(replicas) for r in range(world)]
    specs = [spec_of_shape(shape, world)]
    how = quantize.Quantization(bits, 16)
    # fmt: off
    schemes = {
        (i, r): QuantizedHybridReduce(
            torch.float32, torch.float32, world_size=world, group="g", quantization=how,
            own_rank=r, replicate_group="rg", replicate_size=replicas,
            own_replica=i if keep_own else None,
        )
        for i, r in ranks
    }
    # fmt: on
    emits = {k: _Exchange() for k in ranks}
    works = {
        k: schemes[k].issue(emits[k], 0, schemes[k].copy_in(EAGER, [grads[k]], specs), specs)
        for k in ranks
    }
    rows = [[(i, r) for r in range(world)] for i in range(replicas)]
    across = [[(i, r) for i in range(replicas)] for r in range(world)]
    for stage, groups in enumerate((rows, across, across)):
        for group in groups:
            _deliver([emits[k] for k in group], all_to_all=stage < 2)
        waited = {k: schemes[k].wait(emits[k], stage, works[k]) for k in ranks}
        if stage < 2:
            works = {k: schemes[k].issue(emits[k], stage + 1, waited[k], specs) for k in ranks}
    out = []
    for r in range(world):
        shapes = [_shard(torch.empty(shape), world, r).shape]
        copies = [
            schemes[i, r].copy_out(EAGER, waited[i, r], specs, shapes)[0] for i in range(replicas)
        ]
        assert torch.equal(copies[0], copies[1])  # every replica reads the same values
        out.append(copies[0])
    return torch.cat(out)


@pytest.mark.parametrize("bits", [8, 4])
def test_hybrid_reduction_keeps_each_replicas_own_chunk_exact(bits):
    """Hybrid qgZ rounds four times on the way (the row partner's row, this replica's chunk of
    the row's sum, the other replica's chunk, the replicas' sum); each replica keeping its own
    chunk exact (``own_replica``) drops the second: the squared error falls by about a quarter
    (stochastic roundings of similar steps add their variances), and stays within the four
    steps' bound."""
    torch.manual_seed(bits)
    shape = (128, 64)
    grads = {(i, r): torch.randn(shape) for i in range(2) for r in range(2)}
    mean = sum(grads.values()) / 4
    kept, sent = (_hybrid_reduce(grads, shape, bits, keep) for keep in (True, False))
    # under one step per rounding: of a row (amax <= M), of a pair's sum (2M), of all four's
    # (4M), the sum divided by 4
    top = max(g.abs().max() for g in grads.values())
    assert (kept - mean).abs().max() <= (1 + 2 + 4) * top / quantize.LEVELS[bits] / 4
    ratio = ((kept - mean) ** 2).mean() / ((sent - mean) ** 2).mean()
    assert 0.6 < ratio < 0.9, ratio


def _node_reduce(grads: list, bits: int, nodes: int, size: int, in_place: bool) -> list:
    """Each rank's reduced shards of ``SHAPES`` through ``QuantizedNodeReduce`` on a simulated
    flat group of ``nodes * size`` ranks in nodes of ``size`` (rank ``n * size + j``): the node
    stage delivered as a sum (``in_place``: gloo's all-reduce, each rank taking its part) or a
    reduce-scatter, then the all-to-all among the ranks of one index; and the bytes each rank
    sent across nodes."""
    world = nodes * size
    specs = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    how = quantize.Quantization(bits, 16)
    # fmt: off
    schemes = [
        QuantizedNodeReduce(
            torch.float32, torch.float32, world_size=world, group="g", quantization=how,
            own_rank=r, node_group="n", node_size=size, node_rank=r % size if in_place else None,
            across_group="a", own_node=r // size,
        )
        for r in range(world)
    ]
    # fmt: on
    emits = [_Exchange() for _ in range(world)]
    works = [
        schemes[r].issue(emits[r], 0, schemes[r].copy_in(EAGER, grads[r], specs), specs)
        for r in range(world)
    ]
    for n in range(nodes):
        members = emits[n * size : (n + 1) * size]
        total = sum(m.sent for m in members)
        for j, member in enumerate(members):
            member.received = total if in_place else total.view(size, -1)[j]
    waited = [schemes[r].wait(emits[r], 0, works[r]) for r in range(world)]
    works = [schemes[r].issue(emits[r], 1, waited[r], specs) for r in range(world)]
    sent_across = [e.sent.numel() for e in emits]
    for j in range(size):
        _deliver([emits[n * size + j] for n in range(nodes)], all_to_all=True)
    out = []
    for rank in range(world):
        shapes = [_shard(torch.empty(shape), world, rank).shape for shape in SHAPES]
        received = schemes[rank].wait(emits[rank], 1, works[rank])
        out.append(schemes[rank].copy_out(EAGER, received, specs, shapes))
    return out, sent_across


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("nodes,size,in_place", [(2, 2, True), (2, 2, False), (3, 2, True)])
def test_a_group_across_nodes_sums_exactly_within_each_node_first(bits, nodes, size, in_place):
    """qgZ over ranks in nodes: gradients of the owner's own node only are summed exactly (the
    node's stage is full precision, the owner's node's row never quantized): each shard is
    their mean to the bit; random gradients: within one step of each other node's sum, divided
    by N; what crosses nodes is the nodes' quantized sums of one index: 1/size of what the flat
    exchange of the same bucket sends."""
    torch.manual_seed(bits + 10 * nodes + size)
    world = nodes * size
    for owner in range(world):
        node = range(owner - owner % size, owner - owner % size + size)
        grads = [
            [torch.randn(s) if r in node else torch.zeros(s) for s in SHAPES] for r in range(world)
        ]
        shards, _ = _node_reduce(grads, bits, nodes, size, in_place)
        for i in range(len(SHAPES)):
            want = _shard(sum(grads[r][i] for r in node) / world, world, owner)
            assert torch.equal(shards[owner][i], want), (owner, i)
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(world)]
    shards, sent = _node_reduce(grads, bits, nodes, size, in_place)
    for rank in range(world):
        sums = [
            [sum(grads[n * size + j][i] for j in range(size)) for i in range(len(SHAPES))]
            for n in range(nodes)
        ]
        step = max(g.abs().max() for node_sums in sums for g in node_sums) / quantize.LEVELS[bits]
        for i, got in enumerate(shards[rank]):
            want = _shard(sum(g[i] for g in grads) / world, world, rank)
            assert got.shape == want.shape
            if want.numel():
                assert (got - want).abs().max() <= step * (nodes - 1) / world * (1 + 1e-5)
    specs = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    flat = QuantizedReduceScatter(
        torch.float32, torch.float32, world_size=world, group="g",
        quantization=quantize.Quantization(bits, 16), own_rank=0,
    )  # fmt: skip
    payload, _ = flat.copy_in(EAGER, grads[0], specs)
    assert all(n * size == payload.numel() for n in sent)


def test_options_are_validated_with_the_fix():
    for options, words in (
        ({"weight_quantization": "int4"}, "'int8' or None"),
        ({"gradient_quantization": "fp8"}, "'int8', 'int4' or None"),
        ({"quantization_block": 12}, "multiple of 8"),
        ({"quantization_block": 0}, "multiple of 8"),
    ):
        with pytest.raises(ValueError, match=words):
            z3.Options.from_dict(options)


# ---------------------------------------------------------------- training on gloo ranks

COMPRESSED = {
    "none": {},
    "qwz": {"weight_quantization": "int8"},
    "qgz8": {"gradient_quantization": "int8"},
    "qgz4": {"gradient_quantization": "int4"},
    "both": {"weight_quantization": "int8", "gradient_quantization": "int8"},
    "hpz": {"secondary_shard": 2},
    "hpz_qwz": {"secondary_shard": 2, "weight_quantization": "int8"},
    "zeropp": {
        "secondary_shard": 2,
        "weight_quantization": "int8",
        "gradient_quantization": "int4",
    },
}


def gpt(rank, world, name, codegen):
    options = {"codegen": codegen, "quantization_block": 64, **COMPRESSED[name]}
    out = train_pair(rank, world, "gpt", "adamw", options, steps=3)
    errors = [
        rel_diff(out["grads"][n], out["ref_grads"][n])
        for n in out["grads"]
        if out["grads"][n] is not None
    ]
    return {"losses": out["losses"], "ref_losses": out["ref_losses"], "grad_errors": errors}


def _train_llama(step, model, reference, tokens, targets, rank, world, steps=3):
    """``steps`` AdamW steps of the compiled sharded model (rank's 2 rows) beside the reference
    (all rows); both loss curves, the sharded one averaged over ranks."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    mine = slice(2 * rank, 2 * rank + 2)
    for _ in range(steps):
        loss = llama_loss(step, (tokens[mine], targets[mine]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref = llama_loss(reference, (tokens, targets))
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        ref_losses.append(ref.item())
    return losses, ref_losses


def llama_explained(rank, world, name, codegen="eager"):
    """The Llama's collectives as ``explain`` reports them, and 3 steps of training."""
    options = {"codegen": codegen, "quantization_block": 64, **COMPRESSED[name]}
    torch.manual_seed(0)
    config = TinyLlamaConfig(dim=32, hidden=64, n_layers=2)
    reference = TinyLlama(config)
    model = z3.shard(TinyLlama(config))
    step = torch.compile(model, backend="zero3", options=options)
    tokens, targets = llama_batch(2 * world, config, seed=0)
    report = z3.explain(step, tokens[:2])
    graphs = {
        g.kind: {
            kind: (stats["bytes"], stats["full_bytes"]) for kind, stats in g.collectives.items()
        }
        for g in report.graphs
    }
    groups = {g.kind: g.group_full_bytes for g in report.graphs}
    errors = {g.kind: [info.quantization_error for info in g.gathers] for g in report.graphs}
    reduce_errors = [info.quantization_error for g in report.graphs for info in g.reductions]
    forward = next(g for g in report.graphs if g.kind == "forward")
    losses, ref_losses = _train_llama(step, model, reference, tokens, targets, rank, world)
    out = {
        "graphs": graphs,
        "groups": groups,
        "errors": errors,
        "reduce_errors": reduce_errors,
        "text": str(report),
        "losses": losses,
        "ref_losses": ref_losses,
        "numel": sum(p.numel() for p in reference.parameters()),
        "secondary_bytes": sum(t.bytes for t in forward.saved if t.secondary),
        "peak": report.estimated_step_peak_bytes,
        "shards": [p.to_local().detach().clone() for p in model.parameters()],
    }
    if name == "none":  # the profiler test's uncompressed step: these graphs, warm
        mine = (tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        out["profile"] = _profile_step(step, mine, report)
        model.zero_grad()
    return out


def hybrid(rank, world, name):
    """A (replicate 2, shard 2) mesh: the quantized exchange within a row, then the replicas'
    all-reduce; 3 AdamW steps of the tiny Llama and its collectives."""
    from torch.distributed.device_mesh import init_device_mesh

    options = {"codegen": "eager", "quantization_block": 64, **COMPRESSED[name]}
    torch.manual_seed(0)
    config = TinyLlamaConfig(dim=32, hidden=64, n_layers=2)
    reference = TinyLlama(config)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = z3.shard(TinyLlama(config), mesh=mesh)
    step = torch.compile(model, backend="zero3", options=options)
    tokens, targets = llama_batch(2 * world, config, seed=0)
    report = z3.explain(step, tokens[:2])
    backward = next(g for g in report.graphs if g.kind == "backward")
    losses, ref_losses = _train_llama(step, model, reference, tokens, targets, rank, world)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "all_reduces": backward.collectives["all_reduce"]["count"],
        "replicate_bytes": backward.group_bytes.get("replicate", {}),
        "shards": [p.to_local().detach().clone() for p in model.parameters()],
        "backward": {
            k: (v["bytes"], v.get("full_bytes", v["bytes"]))
            for k, v in backward.collectives.items()
        },
    }


def hpz_errors(rank, world):
    """Compiles that must fail on every rank (no hang) with an error naming the fix."""
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    torch.manual_seed(0)
    config = TinyLlamaConfig(dim=32, hidden=64, n_layers=1)
    tokens, _ = llama_batch(2, config, seed=0)
    messages = []
    for value in (3, 4, "node"):
        torch._dynamo.reset()
        model = z3.shard(TinyLlama(config))
        options = {"codegen": "eager", "secondary_shard": value}
        try:
            torch.compile(model, backend="zero3", options=options)(tokens)
            messages.append(None)
        except Exception as error:  # noqa: BLE001 - dynamo wraps the backend's error
            messages.append(str(error))
    return messages


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def hpz_variant(rank, world, variant, name, layers=None, steps=3):
    """The tiny Llama with or without hpZ (``name``), ``variant``: "ckpt" (each block
    activation-checkpointed), "offload" (shards on disk), "bf16" (mixed precision), "hybrid"
    (a (replicate 2, shard world/2) mesh). Losses, full parameters (rank 0), backward bytes per
    group and shard reads. Two blocks for "ckpt" (its test reads the second block's names), one
    for the others (compile time)."""
    if layers is None:
        layers = 2 if variant == "ckpt" else 1
    import tempfile

    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    config = TinyLlamaConfig(dim=32, hidden=64, n_layers=layers)
    model = TinyLlama(config)
    kwargs: dict = {}
    folder = tempfile.TemporaryDirectory()
    if variant == "ckpt":
        model.layers = torch.nn.ModuleList(_Checkpointed(b) for b in model.layers)
    elif variant == "offload":
        kwargs["offload"] = z3.Offload(params="disk", path=folder.name)
    elif variant == "bf16":
        kwargs["mp_policy"] = z3.MixedPrecision(param_dtype=torch.bfloat16)
    elif variant == "hybrid":
        shape = (2, world // 2)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = z3.shard(model, **kwargs)
    options = {"codegen": "eager", **COMPRESSED[name]}
    step = torch.compile(model, backend="zero3", options=options)
    tokens, targets = llama_batch(2 * world, config, seed=0)
    report = z3.explain(step, tokens[:2])
    backward = next(g for g in report.graphs if g.kind == "backward")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = llama_loss(step, (tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = z3.full_state_dict(model)
    folder.cleanup()
    return {
        "losses": losses,
        "params": params,
        "groups": backward.group_bytes,
        "backward_reloads": len(backward.reloads),
        "gathered": sorted({p for g in report.graphs for b in g.gathers for p in b.params}),
        "json": json.dumps(report.to_dict()),
    }


def profiled(rank, world, name):
    """One step of the tiny Llama under ``torch.profiler``: the collectives the process groups
    ran (their ``c10d::`` operators, bytes of their tensors), beside what ``explain`` reports
    from the graphs."""
    options = {"codegen": "eager", "quantization_block": 64, **COMPRESSED[name]}
    torch.manual_seed(0)
    config = TinyLlamaConfig(dim=32, hidden=64, n_layers=2)
    model = z3.shard(TinyLlama(config))
    step = torch.compile(model, backend="zero3", options=options)
    tokens, targets = llama_batch(2 * world, config, seed=0)
    mine = (tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
    report = z3.explain(step, mine[0])
    llama_loss(step, mine).backward()  # compiled and warm
    return _profile_step(step, mine, report)


def _profile_step(step, mine, report) -> dict:
    """One step of the compiled (and warm) ``step`` under the profiler, beside ``report``."""
    from torch.profiler import ProfilerActivity, profile

    from bench.harness.comm import from_profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        llama_loss(step, mine).backward()
    return {
        "profiled": from_profile(prof),
        "groups": {g.kind: g.group_bytes for g in report.graphs},
        "collectives": {g.kind: g.collectives for g in report.graphs},
    }


def in_nodes(rank, world, name, *args):
    """Scenario ``name`` with the ranks in nodes of 2, as torchrun says (``LOCAL_WORLD_SIZE``)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        return globals()[name](rank, world, *args)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE")


def _scenario(rank, world, name, *args):
    torch._dynamo.reset()
    return globals()[name](rank, world, *args)


GPT_CASES = [("gpt", name, "eager") for name in ("none", "qwz", "qgz8", "qgz4")]
GPT_CASES += [("gpt", "both", "inductor")]
NAMES = ("none", "qwz", "qgz8", "qgz4", "hpz", "hpz_qwz")
LLAMA_CASES = [("llama_explained", name) for name in NAMES] + [("gpt", "hpz", "inductor")]
HYBRID_CASES = [("hybrid", n) for n in ("none", "qgz8", "qgz4")] + [("hpz_errors",)]
# the uncompressed step's profile: llama_explained's (the same graphs, compiled once)
PROFILED = [("profiled", "zeropp")]
PROFILED += [("in_nodes", "llama_explained", "qgz4", codegen) for codegen in ("eager", "inductor")]
HPZ_VARIANTS = [("hpz_variant", v, n) for v in ("ckpt", "offload", "bf16") for n in ("none", "hpz")]


@functools.cache
def gpt_results():
    return run_scenarios(_scenario, 2, GPT_CASES, timeout=1200)


@functools.cache
def llama_results():
    return run_scenarios(
        _scenario, 4, LLAMA_CASES + HYBRID_CASES + HPZ_VARIANTS + PROFILED, timeout=900
    )


# loss over 3 AdamW steps, relative to the uncompressed run's; gradients of the first step
# relative to eager's (max over parameters of max |error| / max |gradient|)
LOSS_BAND = {"qwz": 0.005, "qgz8": 0.005, "qgz4": 0.03, "both": 0.005}
# the tiny Llama (random weights of scale 0.3, AdamW at lr 1e-2: the loss falls from 5.9 to 2.1
# in 4 steps) amplifies int8 weight noise more: measured 1.9% after 4 steps (qgz4 1.3%)
LLAMA_LOSS_BAND = {"qwz": 0.03, "qgz8": 0.005, "qgz4": 0.03}
# hybrid sharding quantizes each gradient twice (within the row, then the replicas' sums): int4
# measured 1.2% / 2.6% at steps 2 / 3 on one machine, 1.1% / 3.5% on another whose float kernels
# differ in the last bits (the stochastic rounding's draws hash the values' bits, so a 1e-7
# difference redraws every element); int8 0.1%
HYBRID_LOSS_BAND = {"qgz8": 0.005, "qgz4": 0.06}
GRAD_BAND = {"qwz": 0.1, "qgz8": 0.05, "qgz4": 0.5, "both": 0.1}


@pytest.mark.parametrize("case", GPT_CASES, ids=lambda c: "-".join(c[1:]))
def test_gpt_trains_within_the_stated_band_of_the_uncompressed_run(case):
    name = case[1]
    exact = gpt_results()[("gpt", "none", "eager")]
    for ours, plain in zip(gpt_results()[case], exact):
        if name == "none":  # the baseline itself is eager training
            assert max(ours["grad_errors"]) <= 1e-5
            assert ours["losses"] == pytest.approx(ours["ref_losses"], rel=1e-5)
            continue
        assert max(ours["grad_errors"]) <= GRAD_BAND[name], ours["grad_errors"]
        assert max(ours["grad_errors"]) > 0  # it did compress
        for loss, base in zip(ours["losses"], plain["losses"]):
            assert abs(loss - base) <= LOSS_BAND[name] * base, (ours["losses"], plain["losses"])


def test_explain_reports_the_compressed_bytes_per_step():
    """Forward all-gathers carry int8 + one float32 per 64 elements (about 0.27x of fp32), the
    backward re-gathers full precision; gradients 0.27x (int8) / 0.14x (int4) of fp32."""
    out = llama_results()
    plain = out[("llama_explained", "none")][0]["graphs"]
    int8 = (1 + 4 / 64) / 4
    int4 = (0.5 + 4 / 64) / 4
    for r in out[("llama_explained", "qwz")]:
        wire, full = r["graphs"]["forward"]["all_gather"]
        assert full == plain["forward"]["all_gather"][0]
        assert wire == pytest.approx(full * int8, rel=0.05)
        assert r["graphs"]["backward"]["all_gather"] == plain["backward"]["all_gather"]
        assert "compressed from" in r["text"]
        assert r["groups"]["forward"]["shard"]["all_gather"] == full
        # the first step's error, per bucket: within half a step of the largest value
        forward_errors = r["errors"]["forward"]
        assert forward_errors and all(e is not None for e in forward_errors)
        assert all(0 < e["max_relative"] <= 1 / 254 + 1e-6 for e in forward_errors)
        assert all(0 < e["mean_relative"] < 0.05 for e in forward_errors)
        assert all(e is None for e in r["errors"]["backward"])  # full precision there
        assert "relative error max" in r["text"]
    for r in out[("llama_explained", "none")]:
        assert all(e is None for errors in r["errors"].values() for e in errors)
    for r in out[("llama_explained", "none")] + out[("llama_explained", "qwz")]:
        assert all(e is None for e in r["reduce_errors"])
    for r8, r4 in zip(out[("llama_explained", "qgz8")], out[("llama_explained", "qgz4")]):
        # the first step's reduced shards against the same step reduced exactly, per bucket
        for r in (r8, r4):
            assert r["reduce_errors"] and all(e is not None for e in r["reduce_errors"])
            errors = r["reduce_errors"]
            assert all(e["mean_relative"] > 0 and e["max_relative"] > 0 for e in errors), errors
            assert "quantized gradient reductions" in r["text"]
        assert all(e["max_relative"] < 0.05 for e in r8["reduce_errors"]), r8["reduce_errors"]
        mean8 = sum(e["mean_relative"] for e in r8["reduce_errors"])
        assert mean8 < sum(e["mean_relative"] for e in r4["reduce_errors"])  # int4 is coarser
    for name, ratio in (("qgz8", int8), ("qgz4", int4)):
        for r in out[("llama_explained", name)]:
            wire, full = r["graphs"]["backward"]["reduce_scatter"]
            assert full == plain["backward"]["reduce_scatter"][0]
            assert wire == pytest.approx(full * ratio, rel=0.05)
            assert r["graphs"]["forward"]["all_gather"] == plain["forward"]["all_gather"]


@pytest.mark.parametrize("name", ["qwz", "qgz8", "qgz4"])
def test_llama_on_four_ranks_trains_within_the_band(name):
    exact = llama_results()[("llama_explained", "none")]
    for ours, plain in zip(llama_results()[("llama_explained", name)], exact):
        assert plain["losses"] == pytest.approx(plain["ref_losses"], rel=1e-5)
        for loss, base in zip(ours["losses"], plain["losses"]):
            assert abs(loss - base) <= LLAMA_LOSS_BAND[name] * base, (
                ours["losses"],
                plain["losses"],
            )
        assert ours["losses"] != plain["losses"]  # it did compress


@pytest.mark.parametrize("name", ["qgz8", "qgz4"])
def test_hybrid_sharding_reduces_quantized_within_a_row_then_across_replicas(name):
    """(replicate 2, shard 2): the uncompressed run equals eager, the quantized one stays within
    the band; its backward sends 0.27x (int8) / 0.14x (int4) the bytes within the row, and sums
    the reduced shards across replicas compressed too (an all-to-all of quantized chunks, then an
    all-gather of the quantized sums: twice the compressed shard for the all-reduce's once
    uncompressed); the replicas end with identical shards."""
    plain = llama_results()[("hybrid", "none")]
    out = llama_results()[("hybrid", name)]
    ratio = {"qgz8": (1 + 4 / 64) / 4, "qgz4": (0.5 + 4 / 64) / 4}[name]
    for ours, base in zip(out, plain):
        assert base["losses"] == pytest.approx(base["ref_losses"], rel=1e-5)
        for loss, want in zip(ours["losses"], base["losses"]):
            assert abs(loss - want) <= HYBRID_LOSS_BAND[name] * want, (ours, base)
        assert ours["losses"] != base["losses"]
        wire, full = ours["backward"]["reduce_scatter"]
        assert full == base["backward"]["reduce_scatter"][0]
        assert wire == pytest.approx(full * ratio, rel=0.05)
        # uncompressed, the replicas' all-reduce carries the summed rows (plus each bucket's
        # tail to a whole block: at most 64 elements); compressed, two collectives per bucket
        reduced, full_reduced = ours["backward"]["all_reduce"]
        base_reduced = base["backward"]["all_reduce"][0]
        buckets = ours["all_reduces"] // 2
        assert ours["all_reduces"] == 2 * base["all_reduces"]
        assert base_reduced <= full_reduced <= base_reduced + buckets * 64 * 4
        # each member's part of the row starts a new block, each replica's chunk is whole
        # blocks: at most one more block per member and per replica
        block_bytes = 64 * ratio * 4
        members = len(ours["shards"])
        assert (
            2 * full_reduced * ratio
            <= reduced
            <= 2 * (full_reduced * ratio + (members + 2 * buckets) * block_bytes)
        )
        assert sum(ours["replicate_bytes"].values()) == reduced  # all on the replicate group
    # rank = 2 * replica + shard: ranks s and s + 2 hold the same shard
    for shard in (0, 1):
        for a, b in zip(out[shard]["shards"], out[shard + 2]["shards"]):
            assert torch.equal(a, b)


def test_the_profiler_sees_the_bytes_explain_reports():
    """What the process groups ran in one step (``torch.profiler``'s ``c10d::`` operators) is
    what ``explain`` reports from the graphs: uncompressed, and with qwZ + hpZ + qgZ int4 (the
    forward's int8 all-gathers, the backward's re-gathers within the node, the gradients' int4
    all-to-all)."""
    out = llama_results()
    runs = {
        "none": [r["profile"] for r in out[("llama_explained", "none")]],
        "zeropp": out[("profiled", "zeropp")],
    }
    for name, per_rank in runs.items():
        for r in per_rank:
            profiled: dict[str, int] = {}
            for kind, size in r["profiled"]:
                kind = "all_gather" if kind == "all_gather" else "reduction"
                profiled[kind] = profiled.get(kind, 0) + size
            graphs = r["collectives"]
            gathers = sum(g.get("all_gather", {}).get("bytes", 0) for g in graphs.values())
            reduced = graphs["backward"]["reduce_scatter"]["bytes"]
            assert profiled == {"all_gather": gathers, "reduction": reduced}, (profiled, graphs)
            if name == "zeropp":  # qgZ sums within the node (gloo: an all-reduce) first
                kinds = {kind for kind, _ in r["profiled"]}
                assert kinds == {"all_gather", "all_reduce", "c10d::alltoall_base_"}, kinds
                assert set(r["groups"]["backward"]) == {"node", "across_nodes"}
    plain, zeropp = runs["none"][0], runs["zeropp"][0]
    forward = plain["collectives"]["forward"]["all_gather"]["bytes"]
    assert zeropp["collectives"]["forward"]["all_gather"]["bytes"] < 0.3 * forward
    gradients = plain["collectives"]["backward"]["reduce_scatter"]["bytes"]
    across = zeropp["groups"]["backward"]["across_nodes"]["reduce_scatter"]
    assert across < 0.15 / 2 * gradients  # int4, and half the rows: only this index's


def test_quantized_gradients_across_nodes_sum_within_the_node_first():
    """4 gloo ranks in nodes of 2 (``LOCAL_WORLD_SIZE=2``), qgZ int4: each bucket is summed at
    full precision within the node (the uncompressed reduction's bytes, on the node group), then
    only the nodes' sums of this rank's index cross nodes, quantized: half the flat quantized
    exchange's bytes, a quarter of its rows' uncompressed; nothing over the whole shard group.
    Training stays in qgZ int4's band of the uncompressed run, under Inductor too."""
    out = llama_results()
    runs = zip(
        out[("in_nodes", "llama_explained", "qgz4", "eager")],
        out[("in_nodes", "llama_explained", "qgz4", "inductor")],
        out[("llama_explained", "qgz4")],
        out[("llama_explained", "none")],
    )
    for ours, inductor, flat, plain in runs:
        # Inductor runs the same two stages; its float kernels differ in the last bits, which
        # redraws the stochastic rounding: within int4's band of eager, not equal to it
        assert inductor["groups"] == ours["groups"]
        assert inductor["losses"][0] == pytest.approx(ours["losses"][0], rel=1e-5)
        for loss, base in zip(inductor["losses"], ours["losses"]):
            assert abs(loss - base) <= LLAMA_LOSS_BAND["qgz4"] * base
        # uncompressed bytes per group (``group_full_bytes``)
        groups, full = ours["groups"]["backward"], plain["groups"]["backward"]
        assert "reduce_scatter" not in groups["shard"], groups  # its all-gathers only
        assert groups["node"]["reduce_scatter"] == full["shard"]["reduce_scatter"]
        assert groups["across_nodes"]["reduce_scatter"] * 2 == full["shard"]["reduce_scatter"]
        flat_wire, _ = flat["graphs"]["backward"]["reduce_scatter"]
        wire, wire_full = ours["graphs"]["backward"]["reduce_scatter"]
        assert wire - full["shard"]["reduce_scatter"] == flat_wire // 2
        assert wire_full == full["shard"]["reduce_scatter"] * 3 // 2
        for loss, base in zip(ours["losses"], plain["losses"]):
            assert abs(loss - base) <= LLAMA_LOSS_BAND["qgz4"] * base, (ours, plain)
        assert ours["losses"] != plain["losses"] and ours["losses"] != flat["losses"]
        errors = ours["reduce_errors"]
        assert errors and all(0 < e["mean_relative"] for e in errors), errors


# ---------------------------------------------------------------- hpZ: secondary shards


@pytest.mark.parametrize("dim0", [1, 5, 8, 13])
def test_secondary_shards_gather_to_the_primary_gathered_buffer(dim0):
    """N = 4 primary shards, nodes of k = 2: each node rank's secondary slice of the full
    parameter holds its two primary shards (padded); the k slices gathered are the N padded
    primary shards gathered, so the same copy-out gives the parameter."""
    from dataclasses import replace

    from zero3_compile.collectives import arithmetic

    full = torch.randn(dim0, 3)
    primary = spec_of_shape(full.shape, 4)
    secondary = replace(primary, group="node", world_size=2, primary_size=4)
    gathered = torch.cat(
        [arithmetic.gather_copy_in([_shard(full, 4, r)], [primary.padded_numel], full.dtype)
         for r in range(4)]
    )  # fmt: skip
    slices = [arithmetic.secondary_slice(full, secondary.padded_numel, i) for i in range(2)]
    assert all(s.numel() == 2 * primary.padded_numel for s in slices)
    assert torch.equal(torch.cat(slices), gathered)
    (back,) = arithmetic.gather_copy_out(torch.cat(slices), [secondary])
    assert torch.equal(back, full)
    assert slices[0].data_ptr() != full.data_ptr()  # its own memory: the full one may die


def test_secondary_shard_option_is_validated_with_the_fix():
    for value in (1, 0, "nodes", 2.0, True):
        with pytest.raises(ValueError, match="secondary_shard must be 'node'"):
            z3.Options.from_dict({"secondary_shard": value})


def test_hpz_is_bit_identical_to_no_hpz_and_backward_gathers_within_the_node():
    """4 gloo ranks in nodes of 2: the same losses and parameters, bit for bit, as without hpZ;
    the backward's all-gathers run on the node group only (none over the shard group) and carry
    the same bytes; the secondary shards are half of what backward gathers, held from forward to
    backward, and the estimated step peak counts them."""
    out = llama_results()
    for ours, plain in zip(out[("llama_explained", "hpz")], out[("llama_explained", "none")]):
        assert ours["losses"] == plain["losses"]
        assert all(torch.equal(a, b) for a, b in zip(ours["shards"], plain["shards"]))
        groups = ours["groups"]["backward"]
        assert "all_gather" not in groups.get("shard", {})
        assert groups["node"]["all_gather"] == plain["groups"]["backward"]["shard"]["all_gather"]
        assert ours["graphs"]["forward"] == plain["graphs"]["forward"]
        assert plain["secondary_bytes"] == 0
        # each rank keeps 1/k of what the backward gathers (the embedding's gradient needs no
        # weight: it has none), padded as the gathered buffer
        assert ours["secondary_bytes"] * 2 == groups["node"]["all_gather"]
        assert ours["peak"] >= plain["peak"] + ours["secondary_bytes"] // 2
        assert "secondary shards (hpZ)" in ours["text"]


def test_hpz_with_quantized_weights_regathers_the_forward_values_within_the_node():
    """hpZ with qwZ: the forward's int8 gathers as before; the backward re-gathers, within the
    node, the dequantized values the forward used; training stays in qwZ's band."""
    out = llama_results()
    runs = zip(out[("llama_explained", "hpz_qwz")], out[("llama_explained", "qwz")])
    for ours, qwz in runs:
        assert ours["graphs"]["forward"] == qwz["graphs"]["forward"]
        assert "all_gather" not in ours["groups"]["backward"].get("shard", {})
        for loss, base in zip(ours["losses"], qwz["losses"]):
            assert abs(loss - base) <= LLAMA_LOSS_BAND["qwz"] * base


def test_hpz_gpt_under_inductor_matches_eager_training():
    for ours in llama_results()[("gpt", "hpz", "inductor")]:
        assert max(ours["grad_errors"]) <= 1e-5
        assert ours["losses"] == pytest.approx(ours["ref_losses"], rel=1e-5)


def test_hpz_refuses_a_node_size_that_does_not_fit_the_shard_group():
    for messages in llama_results()[("hpz_errors",)]:
        bad, whole, node = messages
        assert "secondary_shard=3 must divide" in bad
        assert "secondary_shard=4 must divide" in whole and "drop the option" in whole
        assert "LOCAL_WORLD_SIZE" in node and "torchrun" in node


@pytest.mark.parametrize("variant", ["ckpt", "offload", "bf16"])
def test_hpz_is_bit_identical_with_checkpointing_offload_and_mixed_precision(variant):
    """Activation-checkpointed blocks (their markers are traced unnamed: secondary shards are
    matched by shard, not by name), shards offloaded to disk (the backward then reads none),
    bf16 compute (the secondary shards are bf16)."""
    out = llama_results()
    runs = zip(out[("hpz_variant", variant, "hpz")], out[("hpz_variant", variant, "none")])
    assert out[("hpz_variant", variant, "hpz")][0]["params"]  # rank 0 holds the full ones
    for ours, plain in runs:
        assert ours["losses"] == plain["losses"]
        assert ours["params"].keys() == plain["params"].keys()
        assert all(torch.equal(ours["params"][k], plain["params"][k]) for k in ours["params"])
        assert "all_gather" not in ours["groups"].get("shard", {})
        assert ours["groups"]["node"]["all_gather"] == plain["groups"]["shard"]["all_gather"]
        if variant == "offload":
            assert plain["backward_reloads"] > 0 and ours["backward_reloads"] == 0
        if variant == "ckpt":  # the markers inside the checkpointed blocks are bound too
            assert "" not in ours["gathered"]
            assert "layers.1.inner.attention.wq.weight" in ours["gathered"]
            assert re.search(r'"shape": \["s\d+"\]', ours["json"])  # a saved RNG state's size


@functools.cache
def hybrid_hpz_results():
    cases = [("hpz_variant", "hybrid", name, 1, 2) for name in ("none", "hpz")]
    return run_scenarios(_scenario, 8, cases, timeout=900)


def test_hpz_on_a_hybrid_mesh_is_bit_identical_and_gathers_within_the_node():
    """(replicate 2, shard 4) on 8 ranks, nodes of 2 ranks of each shard group: the backward
    gathers within the node, the gradients still reduce over the shard group and all-reduce
    across replicas, and training is bit-identical to without hpZ."""
    out = hybrid_hpz_results()
    runs = zip(
        out[("hpz_variant", "hybrid", "hpz", 1, 2)], out[("hpz_variant", "hybrid", "none", 1, 2)]
    )
    for ours, plain in runs:
        assert ours["losses"] == plain["losses"]
        assert all(torch.equal(ours["params"][k], plain["params"][k]) for k in ours["params"])
        assert ours["groups"]["node"]["all_gather"] == plain["groups"]["shard"]["all_gather"]
        assert "all_gather" not in ours["groups"]["shard"]
        assert ours["groups"]["replicate"] == plain["groups"]["replicate"]
