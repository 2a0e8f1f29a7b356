"""The loader's I/O: this rank's rows read in large chunks (``hf/rows.py``), and shards written
to the offload store while the next tensor is read (``offload.params.deferred_writes``), the
store's regions preallocated at once (``DiskStore.reserve``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import zero3_compile as z3
from zero3_compile.frontend.loading import adopt, loading
from zero3_compile.hf.rows import RowSlice, header
from zero3_compile.offload import params as offload_params
from zero3_compile.offload.params import deferred_writes
from zero3_compile.offload.store import DiskStore

TENSORS = {
    "matrix": torch.randn(37, 5),
    "half": torch.randn(12, 3, 4).to(torch.bfloat16),
    "vector": torch.randn(9),
    "ints": torch.arange(20, dtype=torch.int64).view(10, 2),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
}
INDICES = [
    ...,
    (...,),
    (slice(3, 17),),
    (slice(3, 17), slice(None)),
    (slice(0, 0), slice(None)),
    (slice(5, None), ...),
    (slice(None, 4),),
]
FALLBACK = [(slice(None), slice(1, 3)), (slice(0, 10, 2),), (slice(1, 3), slice(0, 2))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rows") / "model.safetensors")
    save_file(TENSORS, path)
    return path


def _slices(path):
    entries, start = header(path)
    fd = os.open(path, os.O_RDONLY)
    handle = safe_open(path, framework="pt", device="cpu")
    ours = {
        k: RowSlice(path, fd, entries[k], start, lambda k=k: handle.get_slice(k)) for k in TENSORS
    }
    return ours, handle, fd


@pytest.mark.parametrize("index", INDICES + FALLBACK, ids=repr)
def test_row_slices_read_what_safetensors_reads(checkpoint, index):
    ours, handle, fd = _slices(checkpoint)
    try:
        for key in TENSORS:
            theirs = handle.get_slice(key)
            assert ours[key].get_shape() == theirs.get_shape()
            assert ours[key].get_dtype() == theirs.get_dtype()
            try:
                expected = theirs[index]
            except Exception:  # noqa: BLE001  - an index this tensor cannot take
                continue
            got = ours[key][index]
            assert got.dtype == expected.dtype and torch.equal(got, expected), (key, index)
    finally:
        os.close(fd)


def test_whole_rows_are_read_directly_and_other_indices_fall_back(checkpoint):
    ours, handle, fd = _slices(checkpoint)
    used = []
    try:
        matrix = ours["matrix"]
        matrix.fallback = lambda: used.append(1) or handle.get_slice("matrix")
        assert torch.equal(matrix[2:30, :], TENSORS["matrix"][2:30])
        assert not used  # whole rows: read by preadv, no safetensors slice
        assert torch.equal(matrix[:, 1:3], TENSORS["matrix"][:, 1:3])
        assert used == [1]
    finally:
        os.close(fd)


def test_reserve_preallocates_once_and_regions_stay_apart(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path), "params", 0)
    calls = []
    real = os.posix_fallocate
    monkeypatch.setattr(
        os, "posix_fallocate", lambda fd, o, n: calls.append((o, n)) or real(fd, o, n)
    )
    sizes = [100, 5000, 4096, 1]
    store.reserve(sizes)
    assert len(calls) == 1
    regions = [store.allocate(n) for n in sizes]
    assert len(calls) == 1  # inside the reservation: no fallocate per region
    spans = sorted((off, off + r.nbytes) for r in regions for off in r.offsets)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= calls[0][0] + calls[0][1]
    store.allocate(10)  # past it: preallocated on its own again
    assert len(calls) == 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 12)
        self.b = nn.Linear(12, 8)


def test_deferred_writes_land_in_the_store_and_evict(fake_pg, tmp_path, monkeypatch):
    """Inside ``deferred_writes`` registered shards are written asynchronously, one in flight;
    after it every shard is evicted and reads back the adopted rows."""
    with torch.device("meta"):
        model = _Net()
    z3.shard(model, offload=z3.Offload(params="disk", path=str(tmp_path)))
    asynchronous = []
    real = DiskStore.write_current_async

    def counted(self, region, tensor):
        asynchronous.append(offload_params._deferred.get(id(self)) is not None)
        return real(self, region, tensor)

    monkeypatch.setattr(DiskStore, "write_current_async", counted)
    values = {}
    with loading(model) as states, deferred_writes(states):
        for state in states:
            rows = torch.randn(state.spec.local_shape(state.rank))
            values[state.fqn] = rows
            adopt(state, rows)
    assert asynchronous and all(asynchronous) and len(asynchronous) == len(values)
    assert not offload_params._deferred
    for state in states:
        assert state.offload.evicted
        with offload_params.loaded([state], write_back=False):
            assert torch.equal(state.local(), values[state.fqn]), state.fqn


def test_rows_cast_as_read_equal_the_loaders_cast_and_name_their_origin(checkpoint):
    """Offloaded loads read floating rows straight into the model's dtype, and note where they
    came from (``offload/origins.py``)."""
    from zero3_compile.offload import origins

    entries, start = header(checkpoint)
    fd = os.open(checkpoint, os.O_RDONLY)
    try:
        with origins.tracking(torch.float32):
            rows = RowSlice(checkpoint, fd, entries["half"], start, None, origins.target_dtype())
            got = rows[slice(2, 9)]
            assert got.dtype == torch.float32
            assert torch.equal(got, TENSORS["half"][2:9].float())
            origin = origins.take_origin(got)
            assert origin.dtype == torch.bfloat16 and origin.path == checkpoint
            assert origin.offset == start + entries["half"]["data_offsets"][0] + 2 * 12 * 2
            assert origins.take_origin(got) is None  # each read is one shard's
    finally:
        os.close(fd)


def test_an_origin_is_given_only_for_exactly_the_rows_cast():
    """A loader that changed the values it read (a converter, a transpose) gets no origin: its
    values are written to the store."""
    from zero3_compile.offload import origins

    read = torch.randn(64, 8).to(torch.bfloat16)
    with origins.tracking():
        for values, expected in [
            (read.float(), True),  # the loader's own cast
            (read, True),  # the tensor itself
            (read.float() * 2, False),
            (read.float().t().contiguous().t(), False),  # another layout of the same values
            (torch.cat([read.float()[1:], read.float()[:1]]), False),
        ]:
            fd = os.open(__file__, os.O_RDONLY)
            try:
                origins.record(read, __file__, fd, 0, torch.bfloat16)
            finally:
                os.close(fd)
            found = origins.take_origin(values)
            assert (found is not None) == expected, values
            while origins.take_origin(read) is not None:  # forget what is left
                pass
    assert origins.take_origin(read) is None  # outside tracking: nothing
