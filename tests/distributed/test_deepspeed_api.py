"""DeepSpeed's user APIs (``zero3_compile.deepspeed``) and ``z3.gathered(..., modifier_rank=)``:
writes inside a gathered block, the ``safe_get_*`` / ``safe_set_*`` accessors, the static loss
scale and ``zero_to_fp32`` against single-process eager (2 gloo ranks, one launch)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

import zero3_compile as z3
from zero3_compile import deepspeed as z3ds
from zero3_compile.deepspeed import zero_to_fp32

from ..support.dist_utils import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))  # 6 rows: 3 + 3; 3 rows: 2 + 1


def _batch() -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(7))


def _loss(model, x):
    return model(x).pow(2).mean()


def _raises(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, KeyError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _fill(tensor, value) -> None:
    with torch.no_grad():
        tensor.fill_(value)


# ------------------------------------------------------------------ the ranks' side


def _gathered_writes(rank, world) -> dict:
    out = {}
    model = z3.shard(_model())
    with z3.gathered(model, modifier_rank=1):  # rank 1's writes win, rank 0's are discarded
        _fill(model[0].weight, 7.0) if rank == 1 else _fill(model[0].bias, 3.0)
    out["modifier"] = z3.full_state_dict(model)

    def one_rank_writes():
        with z3.gathered(model):
            if rank == 0:
                _fill(model[0].weight[5], 1.0)  # rows rank 1 holds

    out["one_rank"] = _raises(one_rank_writes)

    def ranks_write_differently():
        with z3.gathered([model[1].weight]):
            _fill(model[1].weight, float(rank))

    out["differently"] = _raises(ranks_write_differently)
    out["after_refused"] = z3.full_state_dict(model)
    with z3.gathered(model.parameters()) as copies:  # the same write everywhere is kept
        out["copies"] = len(copies)
        with torch.no_grad():
            model[1].weight.mul_(2.0)
    out["same_everywhere"] = z3.full_state_dict(model)

    def fails_inside():
        with z3.gathered(model):
            _fill(model[0].weight, -1.0)
            raise ValueError("inside")

    out["failed_block"] = _raises(fails_inside)
    out["after_failure"] = z3.full_state_dict(model)
    # DeepSpeed's class, nested in a block over the whole model, with a parameter list
    with z3.gathered(model):
        with z3ds.GatheredParameters([model[0].bias], modifier_rank=0):
            if rank == 0:
                _fill(model[0].bias, 5.0)
        out["nested_inside"] = model[0].bias.clone()
    out["nested"] = z3.full_state_dict(model)["0.bias"]
    with z3ds.GatheredParameters(model[1].parameters(), enabled=False):
        out["disabled_is_sharded"] = all(p.to_local().shape[0] < 3 for p in model[1].parameters())
    out["bad_rank"] = _raises(lambda: z3.gathered(model, modifier_rank=5).__enter__())
    return out


def _accessors(rank, world) -> dict:
    out = {}
    model = z3.shard(_model())
    weight = model._modules["0"]._parameters["weight"]
    out["grad_before"] = z3ds.safe_get_full_grad(weight)
    out["full_param"] = z3ds.safe_get_full_fp32_param(weight)
    out["full_param_attr"] = z3ds.safe_get_full_fp32_param(model[1].weight)
    out["local_param"] = z3ds.safe_get_local_fp32_param(weight)
    out["plain_tensor"] = z3ds.safe_get_full_fp32_param(torch.ones(2))
    out["set_plain"] = _raises(lambda: z3ds.safe_set_full_fp32_param(torch.ones(2), torch.ones(2)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _loss(model, _batch().chunk(world)[rank]).backward()
    out["grads"] = {n: z3ds.safe_get_full_grad(p) for n, p in model.named_parameters()}
    out["local_grad"] = z3ds.safe_get_local_grad(weight)
    out["state_before_step"] = z3ds.safe_get_full_optimizer_state(weight, "exp_avg")
    optimizer.step()
    out["exp_avg"] = {
        n: z3ds.safe_get_full_optimizer_state(p, "exp_avg") for n, p in model.named_parameters()
    }
    out["step"] = z3ds.safe_get_full_optimizer_state(weight, "step")
    out["local_exp_avg_sq"] = z3ds.safe_get_local_optimizer_state(weight, "exp_avg_sq")
    out["no_such_state"] = _raises(lambda: z3ds.safe_get_full_optimizer_state(weight, "nope"))
    out["params_after_step"] = z3.full_state_dict(model)
    # writes: whole values (every rank passes the same) and this rank's rows
    z3ds.safe_set_full_optimizer_state(weight, torch.full((6, 4), 2.0), "exp_avg")
    z3ds.safe_set_local_optimizer_state(weight, torch.full((12,), float(rank)), "exp_avg_sq")
    out["set_exp_avg"] = z3ds.safe_get_full_optimizer_state(weight, "exp_avg")
    out["set_exp_avg_sq"] = z3ds.safe_get_full_optimizer_state(weight, "exp_avg_sq")
    z3ds.safe_set_full_fp32_param(weight, torch.arange(24.0))
    z3ds.safe_set_local_fp32_param(model[1].bias, torch.full((2 - rank,), 9.0))
    out["set_params"] = z3.full_state_dict(model)
    # a gradient set whole, then a plain SGD step with it
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    sgd.zero_grad()
    z3ds.safe_set_full_grad(weight, torch.ones(6, 4))
    z3ds.safe_set_local_grad(model[0].bias, torch.full((3,), float(rank + 1)))
    out["set_grads"] = (z3ds.safe_get_full_grad(weight), z3ds.safe_get_full_grad(model[0].bias))
    sgd.step()
    out["after_sgd"] = z3.full_state_dict(model)["0.weight"]
    z3ds.safe_update_full_grad_vectorized(model.parameters(), lambda grad, param: grad * 3.0)
    out["updated_grad"] = z3ds.safe_get_full_grad(weight)
    # gradients accumulated with sync off are not readable until reduced
    sgd.zero_grad()
    z3.set_requires_gradient_sync(model, False)
    _loss(model, _batch()).backward()
    out["pending"] = _raises(lambda: z3ds.safe_get_full_grad(weight))
    z3.set_requires_gradient_sync(model, True)
    return out


def _loss_scale(rank, world) -> dict:
    out = {}
    for scaled in (False, True):  # a power of two: the scaled run is the same bits
        model = z3.shard(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = z3ds.LossScaler(1024.0)
        for _ in range(2):
            loss = _loss(model, _batch().chunk(world)[rank])
            (scaler.scale(loss) if scaled else loss).backward()
            scaler.step(optimizer) if scaled else optimizer.step()
            scaler.update()
            optimizer.zero_grad()
        out[f"scaled={scaled}"] = z3.full_state_dict(model)
    # an inf in rank 1's rows only: both ranks skip the step (rank 0's rows are finite)
    embedding = z3.shard(nn.Embedding(4, 2))
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    before = z3.full_state_dict(embedding)["weight"]
    scaler = z3ds.LossScaler(8.0)
    rows = embedding(torch.tensor([0, 3]))
    loss = rows[0].sum() + rows[1].sum() * (float("inf") if rank == 1 else 1.0)
    scaler.scale(loss).backward()
    out["overflow_step"] = scaler.step(optimizer)
    out["skipped"] = scaler.skipped_steps
    out["overflow_unchanged"] = torch.equal(z3.full_state_dict(embedding)["weight"], before)
    out["from_config"] = z3ds.LossScaler.from_config({"fp16": {"enabled": True, "loss_scale": 64}})
    out["dynamic"] = _raises(
        lambda: z3ds.LossScaler.from_config({"fp16": {"enabled": True, "loss_scale": 0}})
    )
    out["from_config"] = out["from_config"].get_scale()
    return out


def _checkpoint(rank, world, path) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10), nn.BatchNorm1d(10))
    model[1].weight = model[0].weight  # tied
    z3.shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    z3.save_checkpoint(path, model, optimizer)
    return {k: v for k, v in z3.full_state_dict(model).items()}


def _offloaded(rank, world, path) -> dict:
    """The accessors on shards offloaded by shard(offload=...) and by offload_states()."""
    out = {}
    for how in ("in memory", "shard(offload=)", "offload_states"):
        offload = z3.Offload(params="disk", grads="disk", path=f"{path}-{rank}")
        model = z3.shard(_model(), **({"offload": offload} if how == "shard(offload=)" else {}))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            _loss(model, _batch().chunk(world)[rank]).backward()
            optimizer.step()
        if how == "offload_states":
            z3ds.offload_states(model, optimizer, device="disk", path=f"{path}-states-{rank}")
        weight = model._modules["0"]._parameters["weight"]
        got = {
            "param": z3ds.safe_get_full_fp32_param(weight),
            "local": z3ds.safe_get_local_fp32_param(weight),
            "grad": z3ds.safe_get_full_grad(weight),
            "exp_avg": z3ds.safe_get_full_optimizer_state(weight, "exp_avg"),
        }
        z3ds.safe_set_full_fp32_param(weight, torch.arange(24.0))
        z3ds.safe_set_local_optimizer_state(weight, torch.full((12,), float(rank)), "exp_avg")
        z3ds.safe_set_full_grad(weight, torch.ones(6, 4))
        got["set"] = [
            z3ds.safe_get_full_fp32_param(weight),
            z3ds.safe_get_full_optimizer_state(weight, "exp_avg"),
            z3ds.safe_get_full_grad(weight),
        ]
        if how == "offload_states":
            z3ds.reload_states(model, optimizer)
        got["after"] = z3.full_state_dict(model)["0.weight"]
        out[how] = got
    return out


def _scenarios(rank, world, path) -> dict:
    return {
        "gathered": _gathered_writes(rank, world),
        "accessors": _accessors(rank, world),
        "loss_scale": _loss_scale(rank, world),
        "checkpoint": _checkpoint(rank, world, path),
        "offloaded": _offloaded(rank, world, path + "-offload"),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds") / "ckpt")
    return run_ranks(_scenarios, 2, path, timeout=600), path


def _part(results, name):
    return [per_rank[name] for per_rank in results[0]]


# ------------------------------------------------------------------ gathered writes


def test_modifier_rank_writes_reach_every_shard_and_other_ranks_writes_are_discarded(results):
    init = _model().state_dict()
    for out in _part(results, "gathered"):
        assert torch.equal(out["modifier"]["0.weight"], torch.full((6, 4), 7.0))
        assert torch.equal(out["modifier"]["0.bias"], init["0.bias"])


def test_writes_that_differ_between_ranks_without_modifier_rank_raise_and_are_discarded(results):
    for out in _part(results, "gathered"):
        assert "changed on 1 of 2 ranks" in out["one_rank"] and "modifier_rank" in out["one_rank"]
        assert "changed differently on the ranks" in out["differently"]
        assert all(torch.equal(v, out["modifier"][k]) for k, v in out["after_refused"].items())
        doubled = out["modifier"]["1.weight"] * 2.0
        assert out["copies"] == 4 and torch.equal(out["same_everywhere"]["1.weight"], doubled)


def test_a_failing_block_discards_its_writes_and_blocks_nest(results):
    for out in _part(results, "gathered"):
        assert out["failed_block"] == "ValueError: inside"
        assert all(
            torch.equal(v, out["same_everywhere"][k]) for k, v in out["after_failure"].items()
        )
        assert torch.equal(out["nested_inside"], torch.full((6,), 5.0))
        assert torch.equal(out["nested"], torch.full((6,), 5.0))
        assert out["disabled_is_sharded"]
        assert out["bad_rank"].startswith("ValueError: zero3: modifier rank 5")


# ------------------------------------------------------------------ safe_get / safe_set


def _reference_step():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _loss(model, _batch()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    exp_avg = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}
    return model, grads, exp_avg, optimizer.state[model[0].weight]


def test_safe_get_full_and_local_values_equal_single_process_eager(results):
    init = _model().state_dict()
    model, grads, exp_avg, weight_state = _reference_step()
    for rank, out in enumerate(_part(results, "accessors")):
        assert out["grad_before"] is None and out["state_before_step"] is None
        assert out["plain_tensor"] is None and out["set_plain"].startswith("ValueError: zero3:")
        assert torch.equal(out["full_param"], init["0.weight"])
        assert torch.equal(out["full_param_attr"], init["1.weight"])
        assert torch.equal(out["local_param"], init["0.weight"].chunk(2)[rank])
        for name, grad in grads.items():
            assert torch.allclose(out["grads"][name], grad, atol=1e-7), name
            assert torch.allclose(out["exp_avg"][name], exp_avg[name], atol=1e-7), name
        assert torch.allclose(out["local_grad"], grads["0.weight"].chunk(2)[rank], atol=1e-7)
        assert float(out["step"]) == 1.0
        local_sq = weight_state["exp_avg_sq"].chunk(2)[rank]
        assert torch.allclose(out["local_exp_avg_sq"], local_sq, atol=1e-9)
        assert "has no 'nope'" in out["no_such_state"]
        want = model.state_dict()
        assert all(
            torch.allclose(v, want[k], atol=1e-6) for k, v in out["params_after_step"].items()
        )


def test_safe_set_full_and_local_values_reach_the_shards(results):
    for out in _part(results, "accessors"):
        assert torch.equal(out["set_exp_avg"], torch.full((6, 4), 2.0))
        assert torch.equal(out["set_exp_avg_sq"], torch.cat([torch.zeros(3, 4), torch.ones(3, 4)]))
        assert torch.equal(out["set_params"]["0.weight"], torch.arange(24.0).view(6, 4))
        assert torch.equal(out["set_params"]["1.bias"], torch.full((3,), 9.0))
        grad, bias_grad = out["set_grads"]
        assert torch.equal(grad, torch.ones(6, 4))
        assert torch.equal(bias_grad, torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
        assert torch.equal(out["after_sgd"], torch.arange(24.0).view(6, 4) - 0.5)
        assert torch.equal(out["updated_grad"], torch.full((6, 4), 3.0))
        assert "accumulating gradients with gradient sync off" in out["pending"]


def test_the_accessors_read_and_write_offloaded_shards_and_states(results):
    for out in _part(results, "offloaded"):
        want = out["in memory"]
        assert torch.equal(want["after"], torch.arange(24.0).view(6, 4))
        for how in ("shard(offload=)", "offload_states"):
            got = out[how]
            for key in ("param", "local", "grad", "exp_avg", "after"):
                assert torch.equal(got[key], want[key]), (how, key)
            assert all(torch.equal(a, b) for a, b in zip(got["set"], want["set"])), how


# ------------------------------------------------------------------ static loss scale


def test_a_static_loss_scale_trains_as_unscaled_and_every_rank_skips_an_overflowing_step(results):
    for out in _part(results, "loss_scale"):
        scaled, plain = out["scaled=True"], out["scaled=False"]
        assert all(torch.equal(scaled[k], plain[k]) for k in plain)
        assert out["overflow_step"] is None and out["skipped"] == 1 and out["overflow_unchanged"]
        assert out["from_config"] == 64.0 and "dynamic loss scale" in out["dynamic"]


# ------------------------------------------------------------------ zero_to_fp32


def test_zero_to_fp32_writes_the_consolidated_weights_offline(results, tmp_path, monkeypatch):
    want = _part(results, "checkpoint")[0]
    _, path = results
    from safetensors.torch import load_file

    zero_to_fp32.main([path, str(tmp_path / "st")])
    assert set(os.listdir(tmp_path / "st")) == {"model.safetensors"}
    got = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    # .bin in several files with an index; every read of the checkpoint bounded by the budget
    calls = []
    load = zero_to_fp32.dcp.load
    monkeypatch.setattr(zero_to_fp32, "_BATCH_BYTES", 100)
    monkeypatch.setattr(
        zero_to_fp32.dcp,
        "load",
        lambda targets, **kw: (
            calls.append(sum(t.nbytes for t in targets.values())) or load(targets, **kw)
        ),
    )
    zero_to_fp32.main([path, str(tmp_path / "bin"), "--bin", "--max-shard-size", "200B"])
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    got = {}
    for name in files:
        got.update(torch.load(tmp_path / "bin" / name, weights_only=True))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    largest = max(v.nbytes for v in want.values())
    assert len(calls) > 2 and max(calls) <= max(100, largest)

    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10), nn.BatchNorm1d(10))
    z3ds.load_state_dict_from_zero_checkpoint(plain, path)
    assert torch.equal(plain[1].weight, want["1.weight"])
    halves = zero_to_fp32.iter_zero_checkpoint(path, dtype=torch.bfloat16, verify=False)
    assert all(t.dtype == torch.bfloat16 for n, t in halves if t.is_floating_point())


def test_zero_to_fp32_refuses_a_damaged_checkpoint(results, tmp_path):
    import shutil

    _, path = results
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(z3.CheckpointCorruptError):
        z3ds.convert_zero_checkpoint_to_fp32_state_dict(damaged, tmp_path / "out")
