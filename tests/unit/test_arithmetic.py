"""The copy-in / copy-out arithmetic around the collectives, on real tensors, against the layout's
definition (``torch.chunk`` shards, a simulated all-gather and reduce-scatter): uneven row counts,
empty shards, several parameters per bucket, casts. No process group is needed."""

from __future__ import annotations

import pytest
import torch

import zero3_compile  # noqa: F401  (registers the zero3:: ops)
from zero3_compile.collectives import arithmetic
from zero3_compile.inspect import measure_peak_bytes
from zero3_compile.sharding.spec import spec_of_shape

SHAPES = [(10, 6), (3,), (5, 2, 3), (4, 4), (1, 7)]  # uneven rows, fewer rows than ranks


def _shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, world)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_empty((0, *full.shape[1:]))


def _ints(shape, dtype=torch.float32):
    """Integer values: sums over ranks are exact, so the expected values need no tolerance."""
    return torch.randint(-50, 50, shape).to(dtype)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graph_ops", [False, True], ids=["eager", "graph-ops"])
def test_gather_round_trip_gives_every_full_parameter(world, dtype, graph_ops):
    torch.manual_seed(world)
    fulls = [torch.randn(shape) for shape in SHAPES]
    layouts = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    sizes = arithmetic.sizes(layouts)
    ops = torch.ops.zero3
    flats = []
    for rank in range(world):
        shards = [_shard(full, world, rank) for full in fulls]
        if graph_ops:
            flat = arithmetic.gather_input(shards, sizes, dtype, copy_in=ops.gather_copy_in)
        else:
            flat = arithmetic.gather_input(shards, sizes, dtype)
        assert flat.shape == (sum(sizes),) and flat.dtype == dtype
        offset = 0  # padding is zeros, never stale memory
        for shard, size in zip(shards, sizes):
            assert not flat[offset + shard.numel() : offset + size].any()
            offset += size
        flats.append(flat)
    gathered = torch.cat(flats)  # what all_gather_into_tensor returns on every rank
    if graph_ops:
        out = arithmetic.gather_copy_out(gathered, layouts, copy_parts=ops.gather_copy_out)
    else:
        out = arithmetic.gather_copy_out(gathered, layouts)
    for got, full in zip(out, fulls):
        assert got.shape == full.shape
        assert torch.equal(got, full.to(dtype))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_lone_shard_or_gradient_needing_no_copy_is_used_as_it_is(world):
    layout = spec_of_shape((4 * world, 3), world)  # no padding
    shard = torch.randn(4, 3)
    flat = arithmetic.gather_input([shard], arithmetic.sizes([layout]), torch.float32)
    assert flat.data_ptr() == shard.data_ptr()
    (full,) = arithmetic.gather_copy_out(torch.cat([flat] * world), [layout])
    assert full.shape == (4 * world, 3)
    grad = torch.randn(4 * world, 3)
    flat = arithmetic.reduce_input([grad], world, arithmetic.sizes([layout]), torch.float32)
    assert flat.data_ptr() == grad.data_ptr()
    cast = arithmetic.reduce_input([grad], world, arithmetic.sizes([layout]), torch.bfloat16)
    assert cast.data_ptr() != grad.data_ptr() and torch.equal(cast, grad.reshape(-1).bfloat16())


@pytest.mark.parametrize("graph_ops", [False, True], ids=["eager", "graph-ops"])
def test_a_lone_member_is_copied_once_and_an_owned_input_never_aliases(graph_ops):
    """A huge lone parameter (a 3B Llama's tied embedding: 1.5 GB of fp32 gradient) must not
    be cast into one buffer and then concatenated into a second; a reduction that writes into
    its input (gloo's in-place all-reduce) gets memory of its own even where no copy is due."""
    world, rows = 2, 4096
    layout = spec_of_shape((rows, 64), world)
    sizes = arithmetic.sizes([layout])
    grad = torch.randn(rows, 64, dtype=torch.bfloat16)
    fp32_bytes = grad.numel() * 4
    ops = torch.ops.zero3
    copy_in = ops.reduce_copy_in.default if graph_ops else arithmetic.reduce_copy_in
    flat = arithmetic.reduce_input([grad], world, sizes, torch.float32, copy_in=copy_in)
    assert torch.equal(flat, grad.reshape(-1).float())
    (peak, _) = measure_peak_bytes(
        lambda: arithmetic.reduce_input([grad], world, sizes, torch.float32, copy_in=copy_in)
    )
    assert fp32_bytes <= peak < 1.5 * fp32_bytes, (peak, fp32_bytes)
    shard = torch.randn(rows // world, 64)
    gather_in = ops.gather_copy_in.default if graph_ops else arithmetic.gather_copy_in
    (peak, _) = measure_peak_bytes(lambda: gather_in([shard], sizes, torch.bfloat16))
    assert shard.numel() * 2 <= peak < 1.5 * shard.numel() * 2, peak
    as_is = torch.randn(rows, 64)
    owned = arithmetic.reduce_input([as_is], world, sizes, torch.float32, copy_in, owned=True)
    assert owned.data_ptr() != as_is.data_ptr() and torch.equal(owned, as_is.reshape(-1))
    # padded: the padding is the copy
    padded_layout = spec_of_shape((rows - 1, 64), world)
    flat = gather_in([shard[:-1]], arithmetic.sizes([padded_layout]), torch.float32)
    assert flat.data_ptr() != shard.data_ptr()
    assert torch.equal(flat[: shard[:-1].numel()], shard[:-1].reshape(-1))
    assert not flat[shard[:-1].numel() :].any()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "grad_dtype,reduce_dtype,shard_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),  # reduce in fp32 (mixed precision)
        (torch.bfloat16, torch.bfloat16, torch.float32),  # bf16 on the wire, fp32 shards
    ],
)
@pytest.mark.parametrize("graph_ops", [False, True], ids=["eager", "graph-ops"])
def test_reduce_round_trip_gives_each_rank_the_mean_of_its_shard(
    world, grad_dtype, reduce_dtype, shard_dtype, graph_ops
):
    torch.manual_seed(world)
    layouts = [spec_of_shape(tuple(shape), world) for shape in SHAPES]
    sizes = arithmetic.sizes(layouts)
    grads = [[_ints(shape, grad_dtype) for shape in SHAPES] for _ in range(world)]  # [rank][i]
    ops = torch.ops.zero3
    inputs = []
    for rank in range(world):
        if graph_ops:
            flat = arithmetic.reduce_input(
                grads[rank], world, sizes, reduce_dtype, copy_in=ops.reduce_copy_in
            )
        else:
            flat = arithmetic.reduce_input(grads[rank], world, sizes, reduce_dtype)
        assert flat.shape == (world * sum(sizes),) and flat.dtype == reduce_dtype
        inputs.append(flat.view(world, -1))
    for rank in range(world):
        reduced = sum(inp[rank] for inp in inputs)  # reduce_scatter_tensor(op="sum")
        expected = [
            _shard(sum(grads[q][i].to(reduce_dtype) for q in range(world)) / world, world, rank)
            for i in range(len(SHAPES))
        ]
        numels = [e.numel() for e in expected]
        if graph_ops:
            out = ops.reduce_copy_out(reduced, sizes, numels, world, shard_dtype)
        else:
            out = arithmetic.reduce_copy_out(
                reduced, sizes, numels, world, [shard_dtype] * len(sizes)
            )
        for got, want in zip(out, expected):
            assert got.dtype == shard_dtype and got.shape == (want.numel(),)
            assert torch.equal(got, want.reshape(-1).to(shard_dtype))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_one_pass_copies_equal_the_traced_forms_bit_for_bit(world):
    """The fixed operations' and the eager schemes' one-pass copies (written into one buffer)
    against the functional forms traced for Inductor: every dtype pair, shards and gradients not
    contiguous, an empty parameter, divisions that round."""
    torch.manual_seed(world)
    shapes = [*SHAPES, (0, 3)]
    layouts = [spec_of_shape(tuple(shape), world) for shape in shapes]
    sizes = arithmetic.sizes(layouts)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for source, target in [(a, b) for a in dtypes for b in dtypes]:
        fulls = [(torch.randn(shape) * 100).to(source) for shape in shapes]
        fulls[0] = fulls[0].t().contiguous().t()  # a column-major gradient
        shards = [_shard(full, world, world - 1) for full in fulls]
        shards[0] = shards[0].t().contiguous().t()  # a column-major shard
        traced = arithmetic.gather_copy_in(shards, sizes, target)
        direct = arithmetic.gather_copy_in_direct(shards, sizes, target)
        assert direct.dtype == target and torch.equal(direct, traced)
        traced = arithmetic.reduce_copy_in(fulls, world, sizes, target)
        direct = arithmetic.reduce_copy_in_direct(fulls, world, sizes, target)
        assert direct.shape == traced.shape and torch.equal(direct, traced)
        reduced = (torch.randn(sum(sizes)) * 1e3).to(source)
        numels = [min(size, full.numel()) for size, full in zip(sizes, fulls)]
        for divisor in (1, 2, 3, 7):
            want = arithmetic.reduce_copy_out(reduced, sizes, numels, divisor, [target] * 6)
            got = arithmetic.reduce_copy_out_direct(reduced, sizes, numels, divisor, [target] * 6)
            assert all(g.dtype == target and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("graph_ops", [False, True], ids=["eager", "graph-ops"])
def test_a_bucket_of_several_is_copied_in_with_one_buffer(graph_ops):
    """A bucket of several gradients cast to the reduction's dtype (bf16 compute, fp32
    reduction) and of several shards cast for the gather: one bucket-sized buffer each, not a
    cast, a padding and a concatenation each allocating one (on CPU their page faults were
    most of a 3B Llama's copy-in time)."""
    world = 2
    shapes = [(96, 64), (33, 64), (64,), (65, 3)]  # padded members among them
    layouts = [spec_of_shape(shape, world) for shape in shapes]
    sizes = arithmetic.sizes(layouts)
    ops = torch.ops.zero3
    grads = [torch.randn(shape, dtype=torch.bfloat16) for shape in shapes]
    copy_in = ops.reduce_copy_in.default if graph_ops else arithmetic.reduce_copy_in_direct
    out_bytes = world * sum(sizes) * 4
    (peak, flat) = measure_peak_bytes(lambda: copy_in(grads, world, sizes, torch.float32))
    assert torch.equal(flat, arithmetic.reduce_copy_in(grads, world, sizes, torch.float32))
    assert out_bytes <= peak < 1.2 * out_bytes, (peak, out_bytes)
    shards = [_shard(torch.randn(shape), world, 1) for shape in shapes]
    gather_in = ops.gather_copy_in.default if graph_ops else arithmetic.gather_copy_in_direct
    (peak, flat) = measure_peak_bytes(lambda: gather_in(shards, sizes, torch.bfloat16))
    assert torch.equal(flat, arithmetic.gather_copy_in(shards, sizes, torch.bfloat16))
    assert sum(sizes) * 2 <= peak < 1.2 * sum(sizes) * 2, peak


# ------------------------------------------------------------------ sizes past 32-bit offsets

# A Llama-3-70B embedding (1.05G elements) and the MLPs of eight of its blocks: one bucket of them
# holds more than 2**31 elements per rank and 2**32 over the ranks; shapes only (meta tensors).
BIG = [(128256, 8192)] + [(28672, 8192)] * 3 * 8


@pytest.mark.parametrize("world", [2, 3])
def test_rows_and_bucket_offsets_past_2_to_the_31_elements(world):
    specs = [spec_of_shape(shape, world, fqn=f"p{i}") for i, shape in enumerate(BIG)]
    sizes = arithmetic.sizes(specs)
    assert sum(sizes) > 2**31 and world * sum(sizes) > 2**32
    for spec in specs[:2]:
        chunks = torch.chunk(torch.empty(spec.shape, device="meta"), world)
        assert [spec.rows(r)[1] for r in range(world)] == [c.shape[0] for c in chunks]
        assert spec.padded_numel * world >= spec.full_numel
    # gathers: the shards of every rank concatenated; copy-out views at offsets past 2**31
    shards = [torch.empty(spec.local_shape(world - 1), device="meta") for spec in specs]
    flat = arithmetic.gather_copy_in(shards, sizes, torch.bfloat16)
    assert flat.shape == (sum(sizes),) and flat.dtype == torch.bfloat16
    gathered = torch.empty(world * sum(sizes), device="meta")
    parts = arithmetic.gather_copy_out_parts(gathered, world, sizes)
    fulls = [arithmetic.gathered_rows(part, spec) for part, spec in zip(parts, specs)]
    assert [tuple(f.shape) for f in fulls] == BIG
    # reductions: rank-major input of N * bucket elements, this rank's shards at exact offsets
    grads = [torch.empty(shape, device="meta") for shape in BIG]
    reduce_in = arithmetic.reduce_copy_in(grads, world, sizes, torch.float32)
    assert reduce_in.shape == (world * sum(sizes),)
    reduced = torch.empty(sum(sizes), device="meta")
    numels = [spec.local_shape(0)[0] * spec.row_numel for spec in specs]
    outs = arithmetic.reduce_copy_out(reduced, sizes, numels, world, [torch.float32] * len(specs))
    assert [o.numel() for o in outs] == numels
    last = reduced.narrow(0, sum(sizes[:-1]), numels[-1])
    assert last.storage_offset() == sum(sizes[:-1]) > 2**31
    # the fixed graph operations agree on the shapes (their fake implementations)
    ops = torch.ops.zero3
    assert ops.gather_copy_in(shards, sizes, torch.bfloat16).shape == flat.shape
    assert ops.reduce_copy_in(grads, world, sizes, torch.float32).shape == reduce_in.shape
