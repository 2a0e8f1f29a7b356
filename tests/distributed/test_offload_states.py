"""Offloaded states as users reach them (2 gloo ranks, one launch for every scenario).

- LoRA with offload: a frozen base offloaded to disk, trainable adapters; then the base unfrozen
  and the adapters frozen (``requires_grad`` toggled after ``shard``); against single-process
  eager training, eagerly and compiled.
- Offloaded parameters and optimizer state read and written through the DTensor API
  (``full_tensor``, ``to_local``, ``.data``, ``copy_``, views, ``repr``, deepcopy, pickling):
  these killed the process with a segmentation fault; now reads give the stored values and
  writes reach the store (a twin without offload does the same and stays bit-identical).
- ``offload_states`` / ``reload_states`` on a CPU model (``device="disk"``: on CPU the
  meaningful move; host memory is where the model is already): every parameter shard, gradient
  and optimizer state tensor gives its memory back, stays readable meanwhile, comes back
  bit-identical, and training goes on bit-identically to a twin that never moved.
"""

from __future__ import annotations

import copy
import functools
import io
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import zero3_compile as z3
from zero3_compile.offload.access import LiveTensor, OffloadedDTensor
from zero3_compile.offload.grads import spooled
from zero3_compile.offload.on_demand import _kinds
from zero3_compile.sharding.state import state_of

from ..support.dist_utils import run_scenarios
from ..support.graph_checks import analyze
from ..support.training import rel_diff

ROWS = 2  # per rank


class LoRA(nn.Module):
    """A linear layer (the base) with a low-rank adapter beside it."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = LoRA(8, 16)
        self.second = LoRA(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _batch(world: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS * world, 8, generator=gen), torch.randn(ROWS * world, 4, generator=gen)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _compiled(model, codegen):
    if codegen is None:
        return model
    return torch.compile(model, backend="zero3", options={"codegen": codegen})


def _freeze(model: nn.Module, base: bool) -> None:
    """``base=True``: the bases frozen, the adapters trained; False: the other way round."""
    for name, param in model.named_parameters():
        param.requires_grad_((".base." in name) != base)


def _global_loss(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


# --------------------------------------------------------------------------- LoRA + offload


def lora(rank, world, codegen, params_tier, grads_tier):
    torch.manual_seed(0)
    model = Adapted()
    _freeze(model, base=True)
    reference = copy.deepcopy(model)  # single-process eager on the whole batch
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    z3.shard(model, offload=z3.Offload(params=params_tier, grads=grads_tier), sync_timeout_s=120)
    opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tile_mb=0.05)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step_model = _compiled(model, codegen)
    params = dict(model.named_parameters())
    bases = [n for n in params if ".base." in n]
    spool = state_of(params[bases[0]]).root.grad_spool
    out = {"losses": [], "ref_losses": [], "base_grads": [], "spooled": []}
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    with z3.record_graphs() as graphs:
        for phase, steps in ((True, 3), (False, 2)):
            if not phase:  # the base unfrozen, the adapters frozen, after shard()
                _freeze(model, base=False)
                _freeze(reference, base=False)
            written = spool.versions_written if spool is not None else 0
            for step in range(steps):
                x, y = _batch(world, seed=10 * phase + step)
                loss = F.mse_loss(step_model(x[mine]), y[mine])
                loss.backward()
                ref_loss = F.mse_loss(reference(x), y)
                ref_loss.backward()
                out["base_grads"].append([params[n].grad is not None for n in bases])
                if grads_tier:  # the trained parameters' gradients in the spool
                    out["spooled"].append(
                        all(spooled(p) is not None for p in params.values() if p.requires_grad)
                    )
                opt.step()
                opt.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
                out["losses"].append(_global_loss(loss, world))
                out["ref_losses"].append(ref_loss.item())
            if phase:
                full = z3.full_state_dict(model)
                out["base_unchanged"] = all(torch.equal(full[n], initial[n]) for n in bases)
                out["base_state"] = sum(len(opt.state.get(params[n], {})) for n in bases)
                out["base_evicted"] = all(
                    state_of(params[n]).offload.evicted
                    and params[n]._local_tensor.untyped_storage().nbytes() == 0
                    for n in bases
                    if params_tier
                )
                out["versions_frozen"] = (
                    spool.versions_written - written if spool is not None else None
                )
                out["reduced_frozen"] = sorted(
                    analyze(graphs).get("backward", {}).get("reduced_params", [])
                )
    out["params"] = z3.full_state_dict(model)
    out["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    out["base_trained"] = all(not torch.equal(out["params"][n], initial[n]) for n in bases)
    out["bases"], out["adapters"] = bases, [n for n in params if n not in bases]
    return out


LORA = [
    ("lora", None, None, "disk"),
    ("lora", None, "disk", None),
    ("lora", None, "disk", "disk"),
    ("lora", "eager", "disk", "disk"),
]


# --------------------------------------------------------------------------- the DTensor API


def access(rank, world):
    """Every read and write on an offloaded parameter and optimizer state tensor, the same on a
    twin without offload; then a step of both."""
    torch.manual_seed(0)
    model = _mlp()
    twin = copy.deepcopy(model)
    z3.shard(model, offload=z3.Offload(params="disk"), sync_timeout_s=120)
    z3.shard(twin, sync_timeout_s=120)
    opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tile_mb=0.05)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)

    def step(seed):
        x, y = _batch(world, seed)
        for m, o in ((model, opt), (twin, twin_opt)):
            F.mse_loss(m(x[mine]), y[mine]).backward()
            o.step()
            o.zero_grad()

    step(0)
    p, t = dict(model.named_parameters())["0.weight"], dict(twin.named_parameters())["0.weight"]
    s, ts = opt.state[p]["exp_avg"], twin_opt.state[t]["exp_avg"]
    out = {"kinds": (type(p).__name__, type(s).__name__)}
    out["evicted"] = (
        p._local_tensor.untyped_storage().nbytes() == 0
        and s._local_tensor.untyped_storage().nbytes() == 0
    )
    reads = {
        "full_tensor": lambda a: a.full_tensor(),
        "to_local": lambda a: a.to_local().clone(),
        "data": lambda a: a.data.to_local().clone(),
        "view": lambda a: a.to_local()[1:3].t().clone(),
        "sum": lambda a: a.to_local().sum(),
        "arithmetic": lambda a: (a * 2).full_tensor(),
        "deepcopy": lambda a: copy.deepcopy(a).full_tensor(),
        "pickle": lambda a: _pickled(a).full_tensor(),
    }
    for name, read in reads.items():
        out[f"param {name}"] = torch.equal(read(p), read(t))
        out[f"state {name}"] = torch.equal(read(s), read(ts))
    out["repr"] = "(offloaded)" in repr(p) and "(offloaded)" in repr(s)
    for a in (p, t):  # differentiable, as DTensor's own
        a.to_local().square().sum().backward()
        a.full_tensor().sin().sum().backward()
        (a * a).sum().full_tensor().backward()
    out["gradients"] = torch.equal(p.grad.full_tensor(), t.grad.full_tensor())
    opt.zero_grad()
    twin_opt.zero_grad()
    writes = {
        "copy_": lambda a: a.copy_(a * 0.5),
        "data": lambda a: a.data.mul_(2),
        "to_local": lambda a: a.to_local().add_(0.25),
        "view": lambda a: a.to_local()[0].zero_(),
        "foreach": lambda a: torch._foreach_mul_([a], 3.0),
    }
    with torch.no_grad():
        for name, write in writes.items():
            for a in (p, t, s, ts):
                write(a)
            out[f"written {name}"] = torch.equal(p.full_tensor(), t.full_tensor()) and torch.equal(
                s.full_tensor(), ts.full_tensor()
            )
    out["evicted after writes"] = (
        p._local_tensor.untyped_storage().nbytes() == 0
        and s._local_tensor.untyped_storage().nbytes() == 0
    )
    try:
        with torch.no_grad():
            p.to_local().resize_(0)
        out["refused"] = "no error"
    except RuntimeError as error:
        out["refused"] = str(error)
    step(1)  # the written values are the ones that train
    out["trained equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), twin.parameters())
    ) and torch.equal(s.full_tensor(), ts.full_tensor())
    return out


def gated(rank, world):
    """A compiled model whose second output's parameters the backend gates (their gradient may
    be absent: ``runtime/gate.py`` passes them through ``view_as``), offloaded, against a twin
    without offload; the second step uses the first output only."""
    from ..support.models import TwoOutputs

    torch.manual_seed(0)
    model = TwoOutputs()
    twin = copy.deepcopy(model)
    losses: dict = {}
    for m, offload in ((model, z3.Offload(params="disk")), (twin, None)):
        z3.shard(m, offload=offload, sync_timeout_s=120)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        step = _compiled(m, "eager")
        for i in range(2):
            x = torch.randn(ROWS, 10, generator=torch.Generator().manual_seed(10 * rank + i))
            first, second = step(x)
            loss = first + second.square().mean() if i == 0 else first
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.setdefault(id(m), []).append(loss.item())
    return {
        "losses equal": losses[id(model)] == losses[id(twin)],
        "trained equal": all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(model.parameters(), twin.parameters())
        ),
    }


def _pickled(tensor):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --------------------------------------------------------------------------- on demand


def on_demand(rank, world, codegen, offloaded):
    """``offloaded``: the model's shards are on disk already (``shard(offload=...)``): the
    gradients and the optimizer state move."""
    torch.manual_seed(0)
    model = _mlp()
    twin = copy.deepcopy(model)
    models, opts = [], []
    for m in (model, twin):
        z3.shard(m, offload=z3.Offload(params="disk") if offloaded else None, sync_timeout_s=120)
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-2))
        models.append(_compiled(m, codegen))
    opt, twin_opt = opts
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    losses = ([], [])

    def forward_backward(seed):
        x, y = _batch(world, seed)
        for i, m in enumerate(models):
            loss = F.mse_loss(m(x[mine]), y[mine])
            loss.backward()
            losses[i].append(_global_loss(loss, world))

    def step():
        for o in opts:
            o.step()
            o.zero_grad()

    for seed in range(2):
        forward_backward(seed)
        step()
    forward_backward(2)  # gradients held over the offload
    params = dict(model.named_parameters())

    def snapshot():
        return {
            "params": {n: p.full_tensor() for n, p in params.items()},
            "grads": {n: p.grad.full_tensor() for n, p in params.items()},
            "state": {
                (n, k): v.full_tensor()
                for n, p in params.items()
                for k, v in opt.state[p].items()
                if getattr(v, "dim", lambda: 0)() > 0
            },
        }

    before = snapshot()
    out = {}
    held = [weakref.ref(p.grad._local_tensor) for p in params.values()]
    held += [
        weakref.ref(v._local_tensor)
        for p in params.values()
        for v in opt.state[p].values()
        if isinstance(v, DTensor)
    ]
    z3.offload_states(model, opt, device="disk")
    z3.offload_states(model, opt, device="disk")  # idempotent
    out["params released"] = all(
        p._local_tensor.untyped_storage().nbytes() == 0 for p in params.values()
    )
    out["params kept"] = all(a is b for a, b in zip(params.values(), model.parameters()))
    out["grads held nowhere"] = all(
        isinstance(p.grad._local_tensor, LiveTensor) for p in params.values()
    )
    out["memory freed"] = all(ref() is None for ref in held)
    out["readable while offloaded"] = _equal(snapshot(), before)
    full = z3.full_state_dict(model)
    out["full_state_dict while offloaded"] = all(
        torch.equal(full[n], before["params"][n]) for n in full
    )
    saved = _pickled(model.state_dict())
    out["torch.save while offloaded"] = all(
        torch.equal(saved[n].full_tensor(), before["params"][n]) for n in saved
    )
    if offloaded:  # the graphs reload the shards themselves; gradients add to the held ones
        forward_backward(9)
    if codegen is not None and not offloaded:
        try:
            models[0](torch.zeros(ROWS, 8))
            out["compiled refused"] = "ran"
        except Exception as error:  # noqa: BLE001 - dynamo wraps it
            out["compiled refused"] = str(error)
    store = state_of(params["0.weight"]).root.parked_states.stores.get("disk")
    size = store.size if store is not None else 0
    z3.reload_states(model, opt)
    z3.reload_states(model, opt)  # idempotent
    out["round trip"] = offloaded or _equal(snapshot(), before)
    out["params resident"] = all(
        p._local_tensor.untyped_storage().nbytes() > 0 for p in params.values()
    ) if not offloaded else True  # fmt: skip
    out["types back"] = {type(p).__name__ for p in params.values()}
    step()
    # a second cycle: only the optimizer state; a write while offloaded reaches the store
    z3.offload_states(model, opt, include=["optim_states"], device="disk")
    out["only state"] = all(
        p._local_tensor.untyped_storage().nbytes() > 0 for p in params.values()
    ) if not offloaded else True  # fmt: skip
    z3.offload_states(model, opt, include=["hp_params", "lp_grads"], device="disk")
    with torch.no_grad():
        for m in (model, twin):
            m[0].weight.mul_(0.5)  # an eager write to a parameter (the store's, for model)
    out["space reused"] = store is None or store.size == size
    z3.reload_states(model, include=["params"])
    out["params only back"] = all(
        isinstance(v._local_tensor, LiveTensor)
        for p in params.values()
        for v in opt.state[p].values()
        if isinstance(v, DTensor)
    ) and (
        offloaded or all(p._local_tensor.untyped_storage().nbytes() > 0 for p in params.values())
    )
    z3.reload_states(model, opt)
    for seed in range(3, 5):
        forward_backward(seed)
        step()
    out["losses equal"] = losses[0] == losses[1]
    out["trained equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), twin.parameters())
    )
    twin_params = dict(twin.named_parameters())
    out["state equal"] = all(
        torch.equal(v.full_tensor(), twin_opt.state[twin_params[n]][k].full_tensor())
        for n, p in params.items()
        for k, v in opt.state[p].items()
        if getattr(v, "dim", lambda: 0)() > 0
    )
    return out


def _equal(a: dict, b: dict) -> bool:
    return all(
        a[kind].keys() == b[kind].keys()
        and all(torch.equal(a[kind][k], b[kind][k]) for k in b[kind])
        for kind in b
    )


ON_DEMAND = [("on_demand", "eager", False), ("on_demand", "eager", True)]


def _scenario(rank, world, name, *args):
    torch._dynamo.reset()
    return globals()[name](rank, world, *args)


@functools.cache
def _results():
    return run_scenarios(_scenario, 2, [*LORA, ("access",), ("gated",), *ON_DEMAND], timeout=900)


@pytest.mark.parametrize("case", LORA, ids=str)
def test_lora_with_offloaded_frozen_base_trains_like_eager(case):
    _, codegen, params_tier, grads_tier = case
    for r in _results()[case]:
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * max(abs(want), 1e-3), (r["losses"], r["ref_losses"])
        for name, want in r["ref_params"].items():
            assert rel_diff(r["params"][name], want) <= 1e-5, name
        # the frozen base: no gradient, no reduction, no optimizer state, untouched on disk
        assert r["base_grads"][:3] == [[False] * 4] * 3 and r["base_grads"][3] == [True] * 4
        assert r["base_unchanged"] and r["base_state"] == 0 and r["base_evicted"]
        if grads_tier:
            assert r["versions_frozen"] == 3 * len(r["adapters"])
            assert all(r["spooled"]), r["spooled"]  # the unfrozen base's too
        if codegen is not None:
            assert r["reduced_frozen"] and not set(r["bases"]) & set(r["reduced_frozen"])
        assert r["base_trained"]  # once unfrozen


def test_offloaded_values_are_read_and_written_through_the_dtensor_api():
    for r in _results()[("access",)]:
        assert r.pop("kinds") == ("OffloadedDTensor", "OffloadedDTensor")
        refused = r.pop("refused")
        assert refused.startswith("zero3:") and "copy_()" in refused, refused
        failed = [name for name, ok in r.items() if ok is not True]
        assert not failed, failed


def test_gated_parameters_of_a_compiled_model_train_offloaded():
    for r in _results()[("gated",)]:
        assert r == {"losses equal": True, "trained equal": True}, r


@pytest.mark.parametrize("case", ON_DEMAND, ids=str)
def test_offload_states_round_trip_is_bit_identical_and_frees_the_memory(case):
    _, codegen, offloaded = case
    for r in _results()[case]:
        refused = r.pop("compiled refused", None)
        if codegen is not None and not offloaded:
            assert "zero3:" in refused and "reload_states" in refused, refused
        assert r.pop("types back") == ({"OffloadedDTensor"} if offloaded else {"DTensor"})
        failed = [name for name, ok in r.items() if ok is not True]
        assert not failed, (failed, r)


def test_include_names_and_refusals():
    assert _kinds(None) == {"params", "grads", "optim_states"}
    assert _kinds(["lp_params", "lp_grads", "contiguous_grad_buffer"]) == {"params", "grads"}
    with pytest.raises(ValueError, match="zero3: offload_states"):
        _kinds(["weights"])
    with pytest.raises(ValueError, match="sharded by zero3_compile.shard"):
        z3.offload_states(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'cpu' or 'disk'"):
        z3.offload_states(nn.Linear(2, 2), device="gpu")
    assert issubclass(OffloadedDTensor, torch.distributed.tensor.DTensor)


def _cuda_round_trip(rank, world):
    group = dist.new_group([0], backend="nccl")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024)).cuda()
    z3.shard(model, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
        opt.step()
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()  # gradients held
    tensors = [p._local_tensor for p in model.parameters()]
    tensors += [p.grad._local_tensor for p in model.parameters()]
    tensors += [v._local_tensor for s in opt.state.values() for v in s.values() if v.dim() > 0]
    expected = sum(t.numel() * t.element_size() for t in tensors)
    before = [t.clone() for t in tensors]
    del tensors
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    z3.offload_states(model, opt)
    offloaded = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    z3.reload_states(model, opt)
    after = [p._local_tensor for p in model.parameters()]
    after += [p.grad._local_tensor for p in model.parameters()]
    after += [v._local_tensor for s in opt.state.values() for v in s.values() if v.dim() > 0]
    return {
        "expected": expected,
        "freed": allocated - offloaded[0],
        "given back": reserved - offloaded[1],
        "equal": len(after) == len(before) and all(map(torch.equal, after, before)),
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_states_gives_accelerator_memory_back():
    """On CUDA (device="cpu": pinned host memory): the parameters', gradients' and optimizer
    state's bytes leave the device's allocator and its cache, and come back bit-identical."""
    from ..support.dist_utils import run_ranks

    (r,) = run_ranks(_cuda_round_trip, 1)
    assert r["equal"], r
    assert r["freed"] >= r["expected"] and r["given back"] >= 0.9 * r["expected"], r
