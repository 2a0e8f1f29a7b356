"""shard(): layout, tied and frozen parameters, buffers, state dicts (4 gloo ranks)."""

from __future__ import annotations

import copy
import functools
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import zero3_compile as z3

from ..support.dist_utils import run_ranks
from ..support.models import GPT, gpt_batch


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(5, 3)  # 3 rows over 4 ranks: rank 3 holds nothing
        self.register_buffer("scale", torch.arange(3.0) + 1)

    def forward(self, x):
        return self.small(x) * self.scale


def _shard_facts(rank, world_size):
    torch.manual_seed(0)
    gpt = GPT()
    full = {k: v.clone() for k, v in gpt.state_dict().items()}
    keys = list(gpt.state_dict().keys())
    idx, _ = gpt_batch(2)
    expected = gpt(idx)
    returned = z3.shard(gpt)
    facts = {
        "returned_same": returned is gpt,
        "keys_unchanged": list(gpt.state_dict().keys()) == keys,
        "tied": gpt.transformer.wte._parameters["weight"] is gpt.lm_head._parameters["weight"],
        "all_dtensor_shard0": all(
            isinstance(p, DTensor) and str(p.placements) == "(Shard(dim=0),)"
            for p in gpt.parameters()
        ),
        "state_dict_dtensor": all(isinstance(v, DTensor) for v in gpt.state_dict().values()),
        "local_rows": {n: p.to_local().shape[0] for n, p in gpt.named_parameters()},
        "chunk_rows": {
            n: (
                torch.chunk(full[n], world_size)[rank].shape[0]
                if rank < len(torch.chunk(full[n], world_size))
                else 0
            )
            for n, _ in gpt.named_parameters()
        },
        "global_shapes_ok": all(
            tuple(p.shape) == tuple(full[n].shape) for n, p in gpt.named_parameters()
        ),
        "full_param_access": torch.equal(gpt.lm_head.weight, full["lm_head.weight"]),
        "eager_forward_diff": (gpt(idx) - expected).abs().max().item(),
    }
    sd = z3.full_state_dict(gpt)
    facts["full_sd_keys"] = list(sd) == keys
    facts["full_sd_plain_equal"] = all(
        type(sd[k]) is torch.Tensor and torch.equal(sd[k], full[k]) for k in keys
    )
    facts["rank0_only_sizes"] = len(z3.full_state_dict(gpt, rank0_only=True))
    plain = GPT()
    plain.load_state_dict(sd, strict=True)  # the unsharded model takes it as is
    facts["plain_load_ok"] = torch.equal(plain.lm_head.weight, full["lm_head.weight"])

    # load_full_state_dict: perturb, load the original back
    with torch.no_grad():
        for p in gpt.parameters():
            p.to_local().add_(1.0)
    z3.load_full_state_dict(gpt, full)
    facts["load_full_roundtrip"] = all(
        torch.equal(v, full[k]) for k, v in z3.full_state_dict(gpt).items()
    )

    # frozen parameters and buffers
    small = WithBuffer()
    small.small.bias.requires_grad_(False)
    x = torch.randn(2, 5)
    ref = copy.deepcopy(small)
    z3.shard(small)
    facts["buffer_whole"] = type(small.scale) is torch.Tensor and small.scale.shape == (3,)
    facts["frozen_sharded"] = (
        isinstance(small.small.bias, torch.Tensor)
        and not small._modules["small"]._parameters["bias"].requires_grad
    )
    facts["small_rows"] = small.small._parameters["weight"].to_local().shape[0]
    out = small(x)
    out.sum().backward()
    ref(x).sum().backward()
    facts["small_forward_equal"] = torch.allclose(out, ref(x))
    facts["frozen_grad_none"] = small.small._parameters["bias"].grad is None
    grad = small.small._parameters["weight"].grad.full_tensor()
    facts["small_grad_is_mean"] = torch.allclose(grad, ref.small.weight.grad)  # same x on all ranks
    dist.barrier()
    return facts


@functools.cache
def facts():
    return run_ranks(_shard_facts, 4, timeout=300)


def test_shard_returns_the_model_with_sharded_dtensor_parameters_under_the_same_names():
    for f in facts():
        assert f["returned_same"] and f["keys_unchanged"] and f["all_dtensor_shard0"]
        assert f["state_dict_dtensor"] and f["global_shapes_ok"]


def test_local_shards_follow_torch_chunk_including_uneven_and_empty():
    for f in facts():
        assert f["local_rows"] == f["chunk_rows"]
    # n_embd=20 rows over 4 ranks: 5 each; vocab 61: 16, 16, 16, 13
    assert [f["local_rows"]["transformer.wte.weight"] for f in facts()] == [16, 16, 16, 13]
    assert [f["small_rows"] for f in facts()] == [1, 1, 1, 0]  # 3 rows over 4 ranks


def test_tied_parameters_stay_tied():
    assert all(f["tied"] for f in facts())


def test_reading_a_parameter_gives_the_full_tensor_and_eager_forward_is_unchanged():
    for f in facts():
        assert f["full_param_access"]
        assert f["eager_forward_diff"] <= 1e-6


def test_full_state_dict_has_plain_full_tensors_under_the_original_keys():
    for rank, f in enumerate(facts()):
        assert f["full_sd_keys"] and f["full_sd_plain_equal"] and f["plain_load_ok"]
        assert f["rank0_only_sizes"] == (len(GPT().state_dict()) if rank == 0 else 0)


def test_load_full_state_dict_restores_every_shard():
    assert all(f["load_full_roundtrip"] for f in facts())


def test_buffers_stay_whole_and_frozen_parameters_get_no_gradient():
    for f in facts():
        assert f["buffer_whole"] and f["frozen_sharded"] and f["frozen_grad_none"]
        assert f["small_forward_equal"] and f["small_grad_is_mean"]


def test_sharding_a_model_without_parameters_is_a_no_op(fake_pg):
    model = nn.ReLU()
    assert z3.shard(model) is model


@pytest.mark.parametrize("shape", [(3,), (7, 5), (1, 2, 3)])
def test_layout_math_matches_torch_chunk(shape):
    from zero3_compile.sharding.spec import spec_of_shape

    full = torch.randn(shape)
    for world in (1, 2, 3, 4, 8):
        spec = spec_of_shape(shape, world)
        chunks = torch.chunk(full, world)
        for rank in range(world):
            expected = chunks[rank] if rank < len(chunks) else full[:0]
            assert spec.rows(rank)[1] == expected.shape[0]
            assert spec.local_shape(rank) == tuple(expected.shape)
            assert torch.equal(spec.chunk(full, rank), expected)
        assert spec.padded_numel * world >= spec.full_numel


# ------------------------------------------------------------------ where training starts (2 ranks)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    model[1].running_mean.fill_(float(seed))  # a buffer each rank sets its own way
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + step))


def _train(model, optimizer, steps, rank=0, world=1):
    for step in steps:
        x = _batch(step).chunk(world)[rank]
        model(x).pow(2).mean().backward()  # the ranks' mean of equal halves: the batch's mean
        optimizer.step()
        optimizer.zero_grad()


def _start_and_optimizer_scenarios(rank, world):
    out = {}
    # ranks initialise differently: every rank starts from rank 0's parameters and buffers
    model = z3.shard(_mlp(seed=rank))
    out["start"] = z3.full_state_dict(model)
    out["running_mean"] = model[1].running_mean.clone()
    out["start_unsynced"] = z3.full_state_dict(z3.shard(_mlp(seed=rank), sync_module_states=False))

    # an optimizer built (and stepped) before shard() trains the sharded model
    model = _mlp(seed=0).eval()  # eval: batch statistics would differ per rank's half
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, optimizer, [0])
    first = weakref.ref(next(iter(model.parameters())))
    z3.shard(model)
    out["original_freed"] = first() is None
    out["holds_shards"] = all(
        p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters())
    )
    _train(model, optimizer, [1, 2], rank, world)
    out["before_shard"] = z3.full_state_dict(model)

    # ... and one built after shard() from parameters kept from before it
    model = _mlp(seed=0).eval()
    kept = list(model.parameters())
    z3.shard(model)
    optimizer = torch.optim.Adam(kept, lr=0.1)
    del kept
    _train(model, optimizer, [0, 1, 2], rank, world)
    out["kept_originals"] = z3.full_state_dict(model)

    # param groups built from module attributes after shard()
    model = z3.shard(_mlp(seed=0).eval())
    optimizer = torch.optim.Adam(
        [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight]}], lr=0.1
    )
    optimizer.add_param_group({"params": model[2].bias, "lr": 0.1})
    optimizer.add_param_group({"params": model[1].parameters(), "lr": 0.1})
    out["attribute_groups_hold_shards"] = [
        p is model._modules[m]._parameters[n]
        for (m, n), p in zip(
            [("0", "weight"), ("0", "bias"), ("2", "weight"), ("2", "bias"), ("1", "weight")],
            [p for group in optimizer.param_groups for p in group["params"]],
        )
    ]
    _train(model, optimizer, [0, 1, 2], rank, world)
    out["attribute_groups"] = z3.full_state_dict(model)

    # ranks holding different models: named before any broadcast of mismatched sizes
    other = nn.Sequential(nn.Linear(4, 6 + rank))
    try:
        z3.shard(other)
        out["different_models"] = "sharded"
    except RuntimeError as error:
        out["different_models"] = str(error)

    # a state that cannot be cut into shards (Adafactor's factored rows): the step says so
    model = _mlp(seed=0).eval()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.1)
    _train(model, optimizer, [0])
    z3.shard(model)
    try:
        _train(model, optimizer, [1], rank, world)
        out["uncuttable"] = "stepped"
    except RuntimeError as error:
        out["uncuttable"] = str(error)
    return out


@functools.cache
def start_and_optimizer_results():
    return run_ranks(_start_and_optimizer_scenarios, 2, timeout=300)


def _reference_training(steps) -> dict[str, torch.Tensor]:
    model = _mlp(seed=0).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, optimizer, steps)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[k], want[k], atol=1e-6) for k in got)


def test_ranks_that_initialise_differently_start_from_rank_0s_parameters_and_buffers():
    rank0 = _mlp(seed=0).state_dict()
    for out in start_and_optimizer_results():
        assert all(torch.equal(v, rank0[k]) for k, v in out["start"].items())
        assert torch.equal(out["running_mean"], torch.zeros(6))  # rank 0's buffer everywhere
        # sync_module_states=False trusts the ranks: here each kept its own rows (a mix)
        mixed = out["start_unsynced"]["0.weight"]
        assert torch.equal(mixed[:3], rank0["0.weight"][:3])
        assert not torch.equal(mixed[3:], rank0["0.weight"][3:])


def test_an_optimizer_built_before_shard_is_repointed_to_the_shards_and_trains():
    want = _reference_training([0, 1, 2])
    for out in start_and_optimizer_results():
        assert out["holds_shards"] and out["original_freed"]
        assert _close(out["before_shard"], want)
        assert _close(out["kept_originals"], want)


def test_param_groups_built_from_module_attributes_hold_the_shards_and_train():
    want = _reference_training([0, 1, 2])
    for out in start_and_optimizer_results():
        assert out["attribute_groups_hold_shards"] == [True] * 5
        assert _close(out["attribute_groups"], want)


def test_ranks_holding_different_models_are_told_so_at_shard():
    for out in start_and_optimizer_results():
        assert out["different_models"].startswith("zero3: the ranks hold different parameters")


def test_an_optimizer_state_that_cannot_be_sharded_raises_at_the_step():
    for out in start_and_optimizer_results():
        assert out["uncuttable"].startswith("zero3: an optimizer built before")
        assert "row_var" in out["uncuttable"] and "after shard()" in out["uncuttable"]
