"""Large-model init: build on meta, shard, materialize module by module."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

import zero3_compile as z3
from zero3_compile.inspect import measure_peak_bytes

from ..support.dist_utils import run_ranks
from ..support.models import GPT, GPTConfig, gpt_batch, gpt_loss

CONFIG = GPTConfig(n_layer=8, n_embd=32, n_head=4)


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def _reference(init: str) -> dict[str, torch.Tensor]:
    """The unsharded model initialised the same way: built on meta, to_empty, then init."""
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(CONFIG)
    model.to_empty(device="cpu")
    model.transformer.wte.weight = model.lm_head.weight  # to_empty unties them; sharding does not
    with torch.no_grad():
        if init == "init_fn":
            model.apply(model._init_weights)
        else:
            for module in _post_order(model):
                if module._parameters and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _materialize_one(init: str, train: bool) -> dict:
    torch.manual_seed(5)
    with torch.device("meta"):
        model = GPT(CONFIG)
    z3.shard(model)
    init_fn = model._init_weights if init == "init_fn" else None
    peak, _ = measure_peak_bytes(lambda: z3.materialize(model, init_fn=init_fn))
    out = {
        "values": z3.full_state_dict(model),
        "peak": peak,
        "local_bytes": sum(p.to_local().numel() * 4 for p in model.parameters()),
        "loss_finite": True,
    }
    if train:  # the materialised model trains (eagerly: no compile needed to show it)
        loss = gpt_loss(model, gpt_batch(2))
        loss.backward()
        out["loss_finite"] = bool(torch.isfinite(loss))
    return out


def _unseeded(rank) -> dict:
    """Each rank draws its own initial values: every rank keeps rank 0's."""
    torch.manual_seed(rank)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    z3.shard(model)
    z3.materialize(model)
    return z3.full_state_dict(model)


def _materialize(rank, world_size):
    return {
        "init_fn": _materialize_one("init_fn", train=True),
        "reset_parameters": _materialize_one("reset_parameters", train=False),
        "unseeded": _unseeded(rank),
    }


@functools.cache
def _results():
    return run_ranks(_materialize, 2, timeout=600)


def results(init: str):
    return [per_rank[init] for per_rank in _results()]


def _check(init: str):
    reference = _reference(init)
    model_bytes = sum(v.numel() * 4 for k, v in reference.items() if k != "lm_head.weight")
    largest_module = max(
        sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in GPT(CONFIG).modules()
    )
    for r in results(init):
        assert r["values"].keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(r["values"][key], value), key
        # no rank materialises the model: its shards plus one module's full parameters (and the
        # chunk copied out of them)
        assert r["peak"] <= r["local_bytes"] + 2 * largest_module, (r["peak"], r["local_bytes"])
        assert r["peak"] < 0.75 * model_bytes
        assert r["loss_finite"]


def test_materialize_with_init_fn_equals_unsharded_init_and_stays_within_shard_memory():
    _check("init_fn")


def test_materialize_with_reset_parameters_equals_unsharded_init():
    _check("reset_parameters")


def test_materialize_on_ranks_without_a_common_seed_keeps_rank_0s_values():
    torch.manual_seed(0)  # what rank 0 drew
    want = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).state_dict()
    for values in results("unseeded"):
        assert all(torch.equal(values[k], v) for k, v in want.items())


def test_module_without_reset_parameters_needs_init_fn(fake_pg):
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))

    with torch.device("meta"):
        model = Bare()
    z3.shard(model)
    import pytest

    with pytest.raises(ValueError, match="no reset_parameters.*pass init_fn"):
        z3.materialize(model)
