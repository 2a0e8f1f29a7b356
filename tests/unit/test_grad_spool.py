"""``SpooledGrad`` (offload/grads.py) on its own: exact values through every kind of access,
aliases, pending factors, the precomputed norm, region reuse and the bound on writes in flight.
Single process, a real disk store."""

from __future__ import annotations

import gc
import threading

import torch

from zero3_compile.offload.grads import GradSpool, SpooledGrad, _Cell
from zero3_compile.offload.store import DiskStore


def _spool(tmp_path, **kwargs) -> GradSpool:
    return GradSpool(DiskStore(str(tmp_path), "grads", 0), **kwargs)


def _spooled(spool, value: torch.Tensor) -> SpooledGrad:
    return SpooledGrad(spool, _Cell(spool.write(value)), value.shape, value.dtype, value.device)


def test_values_come_back_exactly_and_in_place_ops_make_new_versions(tmp_path):
    spool = _spool(tmp_path)
    value = torch.randn(37, 5)
    grad = _spooled(spool, value)
    assert torch.equal(grad.materialize(), value)
    assert torch.equal(grad + 1, value + 1)  # any op reads the values
    other = torch.randn(37, 5)
    grad.add_(other)  # in place: a new version
    assert isinstance(grad, SpooledGrad)
    assert torch.equal(grad.materialize(), value + other)
    real = torch.ones(37, 5)
    real.add_(grad)  # a real tensor plus a spooled one
    assert torch.equal(real, 1 + (value + other))
    target = torch.empty(37, 5)
    target.copy_(grad)
    assert torch.equal(target, value + other)


def test_aliases_share_writes_and_copies_do_not(tmp_path):
    spool = _spool(tmp_path)
    value = torch.randn(8, 3)
    grad = _spooled(spool, value)
    alias, copy = grad.detach(), grad.clone()
    assert isinstance(alias, SpooledGrad) and isinstance(copy, SpooledGrad)
    alias.mul_(2.0)
    assert torch.equal(grad.materialize(), value * 2)
    assert torch.equal(copy.materialize(), value)
    copy.zero_()
    assert torch.equal(copy.materialize(), torch.zeros(8, 3))
    assert torch.equal(grad.materialize(), value * 2)


def test_norm_and_scaling_need_no_read_and_match_memory_bitwise(tmp_path):
    spool = _spool(tmp_path)
    values = [torch.randn(100, 7), torch.randn(3)]
    grads = [_spooled(spool, v) for v in values]
    reads = spool.store.bytes_read
    norms = torch._foreach_norm(grads, 2)
    assert all(torch.equal(n, torch.linalg.vector_norm(v)) for n, v in zip(norms, values))
    assert torch.equal(torch.linalg.vector_norm(grads[0]), torch.linalg.vector_norm(values[0]))
    coef = torch.tensor(0.37)
    torch._foreach_mul_(grads, coef)
    grads[1].mul_(3.0)
    assert spool.store.bytes_read == reads  # neither the norms nor the scaling read
    expected = [v.clone() for v in values]
    torch._foreach_mul_(expected, coef)
    expected[1].mul_(3.0)
    assert all(torch.equal(g.materialize(), e) for g, e in zip(grads, expected))
    # with factors pending the norm is that of the scaled values (read, not approximated)
    assert torch.equal(torch.linalg.vector_norm(grads[1]), torch.linalg.vector_norm(expected[1]))


def test_clip_grad_norm_on_spooled_gradients_equals_memory(tmp_path):
    spool = _spool(tmp_path)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(20, 4)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        g = torch.randn(20, 4)
        p.grad, t.grad = _spooled(spool, g), g.clone()
    for foreach in (False, True):
        total = torch.nn.utils.clip_grad_norm_(params, 0.1, foreach=foreach)
        twin_total = torch.nn.utils.clip_grad_norm_(twins, 0.1, foreach=foreach)
        assert torch.equal(total, twin_total)
    assert all(torch.equal(p.grad.materialize(), t.grad) for p, t in zip(params, twins))


def test_regions_are_reused_once_no_gradient_refers_to_them(tmp_path):
    spool = _spool(tmp_path)
    for _ in range(5):
        grad = _spooled(spool, torch.randn(1000))
        grad.materialize()
        del grad
        gc.collect()
    # one region of 4000 bytes, two slots at most ever reserved (reused after each drop)
    assert spool.store.size <= 2 * 4096, spool.store.size


def test_writes_in_flight_are_bounded(tmp_path):
    spool = _spool(tmp_path, in_flight_bytes=8192)
    gate = threading.Event()
    seen = []
    write_current = spool.store.write_current

    def slow(region, tensor):
        gate.wait(10)
        seen.append(spool.in_flight)
        write_current(region, tensor)

    spool.store.write_current = slow
    first = _spooled(spool, torch.randn(1024))  # 4096 bytes in flight
    second = _spooled(spool, torch.randn(1024))  # 8192
    blocked = threading.Thread(target=lambda: _spooled(spool, torch.randn(1024)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # a third write waits for room
    gate.set()
    blocked.join(10)
    assert not blocked.is_alive()
    assert max(seen) <= 8192
    assert first.materialize().shape == second.materialize().shape == (1024,)


def test_stored_tensors_read_on_use_and_refuse_writes(tmp_path):
    import pytest

    from zero3_compile.offload.deferred import StoredTensor, materialized

    store = DiskStore(str(tmp_path), "optimizer", 0)
    region = store.allocate(4 * 60)
    value = torch.randn(12, 5)
    store.write_current(region, value)
    stored = StoredTensor(store, region, value.shape, value.dtype, value.device)
    assert store.bytes_read == 0
    assert torch.equal(materialized(stored), value)
    assert torch.equal(stored * 2, value * 2)  # any operation reads it
    assert torch.equal(stored.clone(), value)
    assert isinstance(stored.detach(), StoredTensor)
    with pytest.raises(RuntimeError, match="clone"):
        stored.add_(1)
    # the slot that was current when it was handed out, even after a new version is written
    store.write(region, value + 1)
    region.commit()
    assert torch.equal(stored.materialize(), value)


def test_single_copy_stores_take_half_the_disk_and_refuse_lost_values(tmp_path):
    import pytest

    from zero3_compile.offload.store import OffloadError

    double = DiskStore(str(tmp_path / "a"), "optimizer", 0)
    single = DiskStore(str(tmp_path / "b"), "optimizer", 0, double_buffer=False)
    regions = [store.allocate(8192) for store in (double, single)]
    assert double.size == 2 * single.size
    value = torch.randn(2048)
    region = regions[1]
    single.write(region, value)  # a step's new version, in place
    region.commit()
    back = torch.empty_like(value)
    single.read(region, back)
    assert torch.equal(back, value)
    single.write(region, value + 1)
    region.discard()  # the step failed: the previous values are gone
    with pytest.raises(OffloadError, match="double_buffer=True"):
        single.read(region, back)
