"""Bad input to the public surface: a clear error naming the fix, on every rank, within a bounded
time; never a hang, a crash or a silently wrong step.

Single process (the ``fake`` process group): every option with wrong types and values, ``shard``
on odd models and arguments. Two gloo ranks: one rank with another model, other options or
inputs of another dtype; NaN/Inf with a ``GradScaler`` (both ranks skip the step alike); a
checkpoint of another model; one rank that stops feeding batches early.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero3_compile as z3

from ..support.dist_utils import run_ranks

# ------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    "options,message",
    [
        ({"codegen": None}, "codegen=None"),
        ({"codegen": 3}, "codegen=3"),
        ({"bucket_mb": "5"}, "bucket_mb"),
        ({"bucket_mb": True}, "bucket_mb"),
        ({"bucket_mb": float("nan")}, "bucket_mb"),
        ({"bucket_mb": float("inf")}, "bucket_mb"),
        ({"prefetch_depth": 1.5}, "prefetch_depth"),
        ({"prefetch_depth": True}, "prefetch_depth"),
        ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
        ({"max_inflight_bytes": 1.5}, "max_inflight_bytes"),
        ({"reduce_scatter_depth": 0}, "reduce_scatter_depth"),
        ({"reload_depth": -2}, "reload_depth"),
        ({"reshard_after_forward": 1}, "reshard_after_forward"),
        ({"fused_copies": "no"}, "fused_copies"),
        ({"serial_collectives": "gloo"}, "serial_collectives"),
        ({"serial_collectives": 1}, "serial_collectives"),
        ({"sync_timeout_s": 0}, "sync_timeout_s"),
        ({"sync_timeout_s": "10"}, "sync_timeout_s"),
        ({"verify": "yes"}, "verify"),
        ({"dump_dir": 3}, "dump_dir"),
        ({"memory_budget_mb": -5}, "memory_budget_mb"),
        ({"memory_budget_mb": "lots"}, "memory_budget_mb"),
        ({"optimizer_states": -1}, "optimizer_states"),
        ({"optimizer_states": 2.5}, "optimizer_states"),
        ({"bucket": 5}, "unknown option"),
    ],
)
def test_every_option_with_a_wrong_value_is_named(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        z3.Options.from_dict(options)


def test_options_that_are_not_a_dict_are_refused():
    with pytest.raises(TypeError, match="options must be a dict"):
        z3.Options.from_dict([("codegen", "eager")])


# ------------------------------------------------------------------------ shard()


@pytest.mark.usefixtures("fake_pg")
@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"group": 3}, TypeError, "group="),
        ({"mesh": "dp"}, TypeError, "mesh= must be a DeviceMesh"),
        ({"param_dtype": torch.int8}, ValueError, "param_dtype must be a floating-point"),
        ({"reduce_dtype": "bf16"}, ValueError, "reduce_dtype must be a floating-point"),
        ({"mp_policy": "bf16"}, TypeError, r"mp_policy=.*must be a z3\.MixedPrecision"),
        ({"leaf_modules": [3]}, TypeError, "leaf_modules"),
        ({"sync_timeout_s": -1}, ValueError, "sync_timeout_s"),
        ({"offload": "disk"}, TypeError, r"offload=.*must be a z3\.Offload"),
        ({"device": "tpu"}, (ValueError, RuntimeError), "tpu"),
    ],
)
def test_shard_with_bad_arguments_names_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        z3.shard(nn.Linear(4, 4), **kwargs)


@pytest.mark.usefixtures("fake_pg")
def test_shard_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        z3.shard(None)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        z3.shard(torch.nn.Parameter(torch.ones(4)))


class _Odd(nn.Module):
    """Parameters in a ParameterList and a ParameterDict, one shared by two modules under two
    names, a (1,)-shaped one (three of four ranks hold no row of it), buffers, a frozen one."""

    def __init__(self):
        super().__init__()
        self.plist = nn.ParameterList([nn.Parameter(torch.randn(3, 2)) for _ in range(2)])
        self.pdict = nn.ParameterDict({"a": nn.Parameter(torch.randn(5))})
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2)
        self.second.weight = self.first.weight
        self.one = nn.Parameter(torch.randn(1))
        self.frozen = nn.Parameter(torch.randn(4, 2), requires_grad=False)
        self.register_buffer("stat", torch.zeros(3))

    def forward(self, x):
        y = self.second(self.first(x)) + self.plist[0].sum() + self.pdict["a"].sum()
        return y * self.one + (self.frozen.sum() + self.plist[1].mean())


@pytest.mark.usefixtures("fake_pg")
def test_shard_on_odd_models_keeps_names_ties_and_values():
    torch.manual_seed(0)
    reference = _Odd()
    model = _Odd()
    model.load_state_dict(reference.state_dict())
    z3.shard(model)
    assert list(model.state_dict()) == list(reference.state_dict())
    shared = model.first._parameters["weight"]
    assert model.second._parameters["weight"] is shared
    assert model._parameters["one"].to_local().numel() in (0, 1)  # one row, four ranks
    assert not model._parameters["frozen"].requires_grad
    assert all(p.shape == reference.get_parameter(n).shape for n, p in model.named_parameters())
    empty = z3.shard(nn.ReLU())  # no parameters at all: nothing to do, no error
    assert isinstance(empty, nn.ReLU)


# ------------------------------------------------------------------------ two ranks


def _outcome(fn) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
        return "ok", "", time.monotonic() - start
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), time.monotonic() - start


def _mlp(extra: bool = False) -> nn.Module:
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    if extra:
        layers += [nn.Tanh(), nn.Linear(4, 4)]
    return nn.Sequential(*layers)


def _step(model, x, options=None):
    step = torch.compile(model, backend="zero3", options={"codegen": "eager", **(options or {})})
    step(x).float().sum().backward()


def _two_ranks(rank, world, scratch):
    out = {}
    torch._dynamo.reset()
    torch.manual_seed(0)
    # another model on one rank: the ranks' collectives differ
    # (the ranks compare their models when shard() broadcasts the first rank's values)
    out["other model"] = _outcome(
        lambda: _step(z3.shard(_mlp(extra=rank == 1), sync_timeout_s=60), torch.randn(2, 8))
    )
    dist.barrier()
    torch._dynamo.reset()
    # other options on one rank (bucket sizes that split the buckets differently)
    model = z3.shard(_mlp(), sync_timeout_s=60)
    options = {"bucket_mb": 1e-4} if rank == 1 else {}
    out["other options"] = _outcome(lambda: _step(model, torch.randn(2, 8), options))
    dist.barrier()
    torch._dynamo.reset()
    # inputs of another dtype on one rank: gradients of another dtype to reduce
    model = z3.shard(_mlp(), sync_timeout_s=60)
    x = torch.randn(2, 8, dtype=torch.float64 if rank == 1 else torch.float32)
    out["other dtype"] = _outcome(lambda: _step(model.double() if rank == 1 else model, x))
    dist.barrier()
    torch._dynamo.reset()
    # an Inf in one rank's input, with a GradScaler: both ranks skip the step alike
    model = z3.shard(_mlp(), sync_timeout_s=60)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    x = torch.randn(2, 8)
    if rank == 1:
        x[0, 0] = float("inf")
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    scaler.scale(step(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["inf skipped"] = all(torch.equal(before[n], after[n]) for n in before)
    out["scale"] = scaler.get_scale()
    dist.barrier()
    # a checkpoint of another model
    small = z3.shard(_mlp(), sync_timeout_s=60)
    z3.save_checkpoint(os.path.join(scratch, "small"), small)
    other = z3.shard(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)))
    out["other checkpoint"] = _outcome(
        lambda: z3.load_checkpoint(os.path.join(scratch, "small"), other)
    )
    dist.barrier()
    torch._dynamo.reset()
    # one rank stops feeding batches (the end of an uneven epoch) and goes on to save
    model = z3.shard(_mlp(), sync_timeout_s=5)
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    step(torch.randn(2, 8)).sum().backward()
    if rank == 0:
        out["stopped early"] = _outcome(lambda: step(torch.randn(2, 8)).sum().backward())
    else:
        out["stopped early"] = _outcome(
            lambda: z3.save_checkpoint(os.path.join(scratch, "early"), model)
        )
    return out


@functools.cache
def two_ranks():
    scratch = tempfile.mkdtemp(prefix="zero3-fuzz-")
    return run_ranks(_two_ranks, 2, scratch, timeout=400)


@pytest.mark.parametrize("case", ["other model", "other options", "other dtype"])
def test_ranks_that_differ_raise_on_every_rank(case):
    for out in two_ranks():
        kind, message, seconds = out[case]
        assert kind == "CollectiveMismatchError", (case, kind, message)
        assert "rank 0" in message and "rank 1" in message
        assert seconds < 30


def test_an_inf_on_one_rank_skips_the_step_on_every_rank():
    first, second = two_ranks()
    assert first["inf skipped"] and second["inf skipped"]
    assert first["scale"] == second["scale"] == 8.0


def test_a_checkpoint_of_another_model_is_refused_on_every_rank():
    for out in two_ranks():
        kind, message, _ = out["other checkpoint"]
        assert kind != "ok"
        assert "0.weight" in message or "size" in message.lower(), message


def test_a_rank_that_stops_early_is_named_within_the_timeout():
    first, second = two_ranks()
    kind, message, seconds = first["stopped early"]
    assert kind == "CollectiveMismatchError", message
    # named either as missing or by what it is doing instead
    assert "rank 1" in message or "rank(s) [1]" in message, message
    assert seconds < 30
    assert second["stopped early"][0] != "ok"  # its save needed rank 0: an error, not a hang
