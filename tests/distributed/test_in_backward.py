"""``offload_optimizer(in_backward=True)``: each parameter steps during the backward, beside
its compute (offload/optim/in_backward.py). 2 gloo ranks; every run is compared with the same model
and batches under ``offload_optimizer`` without it: losses, parameters and optimizer state
bit-identical; each refusal raises its reason on every rank and leaves the previous state."""

from __future__ import annotations

import functools

import pytest
import torch

import zero3_compile as z3
from zero3_compile.sharding.state import state_of

from ..support.dist_utils import run_scenarios
from ..support.models import GPT, GPTConfig, gpt_batch, gpt_loss
from .test_offload import _full_optimizer_state


def _setup(config, in_backward, optimizer="adamw", double_buffer=True, tile_mb=0.05):
    torch.manual_seed(0)
    model = GPT(config)
    offload = z3.Offload(params="disk", grads="disk", double_buffer=double_buffer)
    z3.shard(model, offload=offload, sync_timeout_s=120)
    if optimizer.startswith("adamw"):
        fused = optimizer == "adamw-fused"  # one kernel per tensor: the whole and a piece alike
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    opt = z3.offload_optimizer(
        inner, tile_mb=tile_mb, double_buffer=double_buffer, in_backward=in_backward
    )
    return model, opt


def _batch(rank, world, config, seed):
    idx, targets = gpt_batch(2 * world, config, seed=seed)
    mine = slice(2 * rank, 2 * rank + 2)
    return idx[mine], targets[mine]


def _steps(step, opt, rank, world, config, sched=None, alternate=False, norms=None) -> list:
    """Three steps on each rank's slice; ``alternate``: zero_grad(set_to_none=False) every
    other step; ``norms``: a list that receives each step's gradient norm (clip_grad_norm_
    with no bound, as the Hugging Face Trainer logs it)."""
    losses = []
    for i in range(3):
        loss = gpt_loss(step, _batch(rank, world, config, i))
        loss.backward()
        if norms is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            norms.append(torch.nn.utils.clip_grad_norm_(params, float("inf")).item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=not alternate or i % 2 == 0)
        losses.append(loss.item())
    return losses


def identical(rank, world, codegen, optimizer, vocab):
    """Three steps with a scheduler, zero_grad both ways; a vocabulary of 512 makes the tied
    embedding larger than a tile (it steps in pieces)."""
    config = GPTConfig(vocab_size=vocab, n_embd=64)
    runs = {}
    for in_backward in (True, False):
        model, opt = _setup(config, in_backward, optimizer)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        step = model
        if codegen is not None:
            step = torch.compile(model, backend="zero3", options={"codegen": codegen})
        store = state_of(next(model.parameters())).offload.store
        read_before = store.bytes_read
        norms = []
        losses = _steps(step, opt, rank, world, config, sched, alternate=True, norms=norms)
        offloaded = opt._zero3_offload
        runs[in_backward] = {
            "losses": losses,
            "norms": norms,
            "params": z3.full_state_dict(model),
            "unique_params": len(list(model.parameters())),
            "state": _full_optimizer_state(opt),
            "windows": offloaded.in_backward.windows if in_backward else None,
            "split": (
                (offloaded.in_backward.stepped_in_backward, offloaded.in_backward.stepped_after)
                if in_backward
                else None
            ),
            "pieces": offloaded.pieces_stepped,
            "shards_read": store.bytes_read - read_before,
            "reused": offloaded.in_backward.reused_bytes if in_backward else None,
            "untied_bytes": sum(
                p.to_local().numel() * p.element_size()
                for p in model.parameters()
                if not state_of(p).tied
            ),
            "evicted": all(
                p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters()
            ),
        }
        torch._dynamo.reset()
    mine, plain = runs[True], runs[False]
    return {
        "losses": (mine["losses"], plain["losses"]),
        "norms": (mine["norms"], plain["norms"]),
        "unique_params": mine["unique_params"],
        "params_equal": all(torch.equal(mine["params"][k], v) for k, v in plain["params"].items()),
        "state_equal": len(mine["state"]) == len(plain["state"])
        and all(torch.equal(a, b) for a, b in zip(mine["state"], plain["state"])),
        "windows": mine["windows"],
        "split": mine["split"],
        "pieces": (mine["pieces"], plain["pieces"]),
        "evicted": mine["evicted"],
        "shards_read": (mine["shards_read"], plain["shards_read"]),
        "reused": mine["reused"],
        "untied_bytes": mine["untied_bytes"],
    }


def inductor(rank, world):
    """Inductor's code reuses a gradient's buffer once ``spool_grad`` ran, while the spool's
    write (and the in-backward stepping thread) still reads it: against the same model without
    offload, compiled alike, losses and parameters are the same bits, both with the gradients
    spooled for a plain optimizer and stepped in the backward."""
    config = GPTConfig(n_layer=4, n_embd=32)
    stepped, stepped_opt = _setup(config, True)
    torch.manual_seed(0)
    spooled = GPT(config)
    z3.shard(spooled, offload=z3.Offload(grads="disk"), sync_timeout_s=120)
    torch.manual_seed(0)
    twin = GPT(config)
    z3.shard(twin, sync_timeout_s=120)
    runs = []
    for m, o in (
        (stepped, stepped_opt),
        (spooled, torch.optim.AdamW(spooled.parameters(), lr=1e-2, weight_decay=0.1)),
        (twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)),
    ):
        step = torch.compile(m, backend="zero3", options={"codegen": "inductor"})
        losses = _steps(step, o, rank, world, config)
        runs.append((losses, z3.full_state_dict(m)))
        torch._dynamo.reset()
    twin_losses, twin_params = runs[-1]
    return {
        "losses": [losses for losses, _ in runs],
        "params_equal": [
            all(torch.equal(params[k], v) for k, v in twin_params.items()) for _, params in runs
        ],
        "stepped_in_backward": stepped_opt._zero3_offload.in_backward.stepped_in_backward,
    }


def refusals(rank, world, double_buffer):
    """What needs the gradients after the backward raises, undoes the backward's steps (the
    state after it equals one more plain step from the same point), and training goes on."""
    config = GPTConfig()
    model, opt = _setup(config, True, double_buffer=double_buffer)
    twin, twin_opt = _setup(config, False)
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    twin_step = torch.compile(twin, backend="zero3", options={"codegen": "eager"})
    out = {}

    def train(i, m, o):
        gpt_loss(m, _batch(rank, world, config, i)).backward()
        o.step()
        o.zero_grad()

    train(0, step, opt)
    train(0, twin_step, twin_opt)

    def attempt(name, misuse):
        gpt_loss(step, _batch(rank, world, config, 1)).backward()
        try:
            misuse()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = str(error)
        opt.zero_grad()

    plain = GPT(config)
    z3.shard(plain, offload=z3.Offload(params="disk"), sync_timeout_s=120)
    try:
        z3.offload_optimizer(torch.optim.AdamW(plain.parameters()), in_backward=True)
        out["no_spool"] = "no error"
    except ValueError as error:
        out["no_spool"] = str(error)
    attempt("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    if not double_buffer:
        try:
            train(1, step, opt)
            out["after_lost"] = "no error"
        except OSError as error:
            out["after_lost"] = str(error)
        return out
    last = list(model.parameters())[-1]  # not the tied embedding (spooled, readable)
    attempt("read", lambda: last.grad.sum())
    attempt("scale", lambda: [p.grad.mul_(0.5) for p in model.parameters()])

    def second_backward():
        gpt_loss(step, _batch(rank, world, config, 2)).backward()

    attempt("second_backward", second_backward)

    def lr_change():
        opt.param_groups[0]["lr"] = 0.5
        try:
            opt.step()
        finally:
            opt.param_groups[0]["lr"] = 1e-2

    attempt("lr_change", lr_change)

    def dropped():
        opt.zero_grad()
        opt.step()

    attempt("dropped", dropped)
    # training goes on from the state of the first step: equal to the plain twin
    for i in (1, 2):
        train(i, step, opt)
        train(i, twin_step, twin_opt)
    params, twin_params = z3.full_state_dict(model), z3.full_state_dict(twin)
    out["params_equal"] = all(torch.equal(params[k], v) for k, v in twin_params.items())
    out["state_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(_full_optimizer_state(opt), _full_optimizer_state(twin_opt))
    )
    # reading a committed gradient after step() also refuses
    gpt_loss(step, _batch(rank, world, config, 3)).backward()
    opt.step()
    try:
        last.grad.sum()
        out["after_step"] = "no error"
    except RuntimeError as error:
        out["after_step"] = str(error)
    opt.zero_grad()

    def accumulated():  # the backward above ran with sync off: this one sees its pending sinks
        z3.set_requires_gradient_sync(model, True)
        gpt_loss(step, _batch(rank, world, config, 2)).backward()

    z3.set_requires_gradient_sync(model, False)
    attempt("accumulated", accumulated)
    return out


def _scenario(rank, world, name, *args):
    torch._dynamo.reset()
    return globals()[name](rank, world, *args)


CASES = [
    ("identical", "eager", "adamw", 61),
    ("identical", "eager", "adamw", 512),
    ("identical", None, "sgd", 512),
    ("identical", "eager", "adamw-fused", 512),
    ("refusals", True),
    ("refusals", False),
    ("inductor",),
]


@functools.cache
def _results():
    return run_scenarios(_scenario, 2, CASES, timeout=900)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "identical"], ids=str)
def test_in_backward_steps_are_bit_identical_to_offload_optimizer(case):
    for r in _results()[case]:
        mine, plain = r["losses"]
        assert mine == plain and mine[-1] != mine[0], r
        # the norm of gradients the backward stepped with, read without their values; a clip
        # that changes nothing (no bound, or the norm under it) passes
        assert r["norms"][0] == r["norms"][1] and min(r["norms"][0]) > 0, r
        assert r["params_equal"] and r["state_equal"], r
        assert r["windows"] == 3 and r["evicted"], r
        # every parameter but the tied embedding stepped in the backward, 3 times
        in_backward, after = r["split"]
        assert after == 3 and in_backward == 3 * (r["unique_params"] - 1), r
        if case[3] == 512:  # the tied embedding steps in pieces in both modes
            assert r["pieces"][0] > 0 and r["pieces"][1] > 0, r
        # compiled, a step uses the values its backward's gather read: a parameter the backward
        # gathers reads its shard twice a step (forward, backward), not three times; the others
        # (position embedding, biases: their gradients need no values) as before
        mine_read, plain_read = r["shards_read"]
        assert mine_read == plain_read - r["reused"], r
        if case[1] is None:  # uncompiled: eager gathers, nothing kept
            assert r["reused"] == 0, r
        else:
            assert r["reused"] > 0.9 * 3 * r["untied_bytes"], r


def test_inductor_gradients_are_copied_before_the_backward_reuses_their_buffers():
    for r in _results()[("inductor",)]:
        stepped, spooled, twin = r["losses"]
        assert stepped == twin and spooled == twin and all(r["params_equal"]), r
        assert r["stepped_in_backward"] > 0, r


def test_what_needs_gradients_after_the_backward_is_refused_and_undone():
    for r in _results()[("refusals", True)]:
        names = ("clip", "read", "scale", "lr_change", "dropped", "second_backward", "accumulated")
        for name in names:
            assert r[name].startswith("zero3: "), (name, r[name])
            assert "in_backward=False" in r[name], (name, r[name])
        assert "clip_grad_norm_" in r["clip"]
        assert "second gradient" in r["second_backward"]
        assert "'lr'" in r["lr_change"]
        assert "dropped" in r["dropped"]
        assert "gradient sync off" in r["accumulated"]
        assert "undone" in r["clip"]
        assert r["params_equal"] and r["state_equal"], r
        assert "zero the gradients" in r["after_step"].lower(), r["after_step"]
        assert "Offload(params='disk', grads='disk')" in r["no_spool"], r["no_spool"]


def test_a_refusal_with_one_copy_on_disk_says_the_state_is_lost():
    for r in _results()[("refusals", False)]:
        assert "lost" in r["clip"] and "checkpoint" in r["clip"], r["clip"]
        assert "lost" in r["after_lost"], r["after_lost"]


def test_setups_it_cannot_run_are_refused_by_name():
    model = GPT(GPTConfig())
    with pytest.raises(ValueError, match="sharded by zero3.shard"):
        z3.offload_optimizer(torch.optim.AdamW(model.parameters()), in_backward=True)


class _OwnAdamW(torch.optim.AdamW):
    """A user's optimizer class: its step could read more than one element."""


def test_an_optimizer_not_known_to_be_elementwise_is_refused():
    model = GPT(GPTConfig())
    with pytest.raises(ValueError, match="reads only that element"):
        z3.offload_optimizer(_OwnAdamW(model.parameters()), in_backward=True)
