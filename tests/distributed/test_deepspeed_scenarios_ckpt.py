"""DeepSpeed's ZeRO-3 checkpoint scenarios (``tests/unit/checkpoint/``, ``TestZeroToFP32``) that
have a counterpart here, on 2 gloo ranks, each compared bit for bit with a run that did not save:

- a save before the first optimizer step changes nothing, and loads as a fresh optimizer
  (DeepSpeed's ``test_immediate_save_load`` / ``test_load_immediate_save``; torch's state-dict
  helpers used to step the optimizer once with lr 0, so Adam's step count was off by one);
- a checkpoint loaded into a fresh model and optimizer trains on bit-identically; loaded without
  the optimizer it gives the model only (``test_load_optimizer_state`` /
  ``test_not_load_optimizer_state`` / ``test_load_module_only``);
- frozen parameters: in the checkpoint, without optimizer state, and in the consolidated full
  state dict after accumulation (``TestZeROCheckpointFrozenWeights``, ``TestZeroToFP32``);
- a save (and a full state dict) inside a gradient-accumulation window, where the pending
  gradients stay with the training (``test_save_before_accum_grad_is_done``).

- another world size: saved at 1 rank and resumed at 2, saved at 2 and resumed in one process
  without sharding (DeepSpeed's elastic ``test_elastic_checkpoint_change_dp``; 2 to 3 ranks and
  into offloaded state are in ``test_checkpoint.py``), equal to the run that went on where it was.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero3_compile as z3

from ..support.dist_utils import run_ranks
from ..support.training import rel_diff

STEPS = 3
GLOBAL_BATCH = 4  # split over the ranks: the same data at any world size


def _model(frozen: bool = False, seed: int = 11) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    if frozen:
        for p in model[0].parameters():
            p.requires_grad_(False)
    return model


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    # weight decay in Adam's gradient: a zero-lr initialising step leaves state behind
    return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batch(rank: int, world: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def _backward(model, rank, world, seed) -> None:
    x, y = _batch(rank, world, seed)
    F.mse_loss(model(x), y).backward()


def _train(model, opt, rank, world, first: int, steps: int = STEPS, micro: int = 1) -> None:
    for step in range(first, first + steps):
        for k in range(micro):
            if micro > 1:
                z3.set_requires_gradient_sync(model, k == micro - 1)
            _backward(model, rank, world, 10 * step + k)
        opt.step()
        opt.zero_grad()


def _params(model) -> dict[str, torch.Tensor]:
    return {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in model.named_parameters()
    }


def _optim(model, opt) -> dict[str, torch.Tensor]:
    index = {id(p): n for n, p in model.named_parameters()}
    return {
        # copies: Adam increments its step tensor in place
        f"{index[id(p)]}.{key}": value.full_tensor()
        if hasattr(value, "full_tensor")
        else value.clone()
        for p, state in opt.state.items()
        for key, value in state.items()
    }


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _outcome(fn):
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - reported by the tests
        return f"{type(error).__name__}: {error}"


def _before_the_first_step(rank, world, folder) -> dict:
    """Save before step 1, train; train without saving; load that checkpoint into a fresh model
    and optimizer, and into the trained ones, and train."""
    out = {}
    plain = z3.shard(_model())
    plain_opt = _adam(plain)
    _train(plain, plain_opt, rank, world, 0)
    saved = z3.shard(_model())
    saved_opt = _adam(saved)
    path = os.path.join(folder, "unstepped")
    z3.save_checkpoint(path, saved, saved_opt)
    out["state_after_save"] = len(saved_opt.state)
    _train(saved, saved_opt, rank, world, 0)
    out["training_unchanged"] = _same(_params(saved), _params(plain)) and _same(
        _optim(saved, saved_opt), _optim(plain, plain_opt)
    )
    # into a fresh model and optimizer (DeepSpeed's immediate save and load)
    fresh = z3.shard(_model(seed=99))  # other values: the load must set them
    fresh_opt = _adam(fresh)
    z3.load_checkpoint(path, fresh, fresh_opt)
    out["fresh_state_after_load"] = len([s for s in fresh_opt.state.values() if s])
    _train(fresh, fresh_opt, rank, world, 0)
    out["fresh_resumes"] = _same(_params(fresh), _params(plain)) and _same(
        _optim(fresh, fresh_opt), _optim(plain, plain_opt)
    )
    # into the trained ones: the optimizer's state goes back to none
    z3.load_checkpoint(path, saved, saved_opt)
    _train(saved, saved_opt, rank, world, 0)
    out["trained_resumes"] = _same(_params(saved), _params(plain))
    # and saving again right after loading it (DeepSpeed's load then immediate save)
    again = z3.shard(_model(seed=98))
    again_opt = _adam(again)
    z3.load_checkpoint(path, again, again_opt)
    z3.save_checkpoint(os.path.join(folder, "unstepped-again"), again, again_opt)
    _train(again, again_opt, rank, world, 0)
    out["again_resumes"] = _same(_params(again), _params(plain))
    # an offloaded optimizer (its state created in the store at the first step): the same
    runs = {}
    for how in ("unsaved", "saved", "loaded"):
        model = z3.shard(_model(seed=99 if how == "loaded" else 11))
        opt = z3.offload_optimizer(_adam(model), tier="disk", path=folder)
        if how == "saved":
            z3.save_checkpoint(os.path.join(folder, "unstepped-offloaded"), model, opt)
        if how == "loaded":
            z3.load_checkpoint(os.path.join(folder, "unstepped-offloaded"), model, opt)
        _train(model, opt, rank, world, 0)
        runs[how] = _params(model)
    out["offloaded"] = _same(runs["saved"], runs["unsaved"]) and _same(
        runs["loaded"], runs["unsaved"]
    )
    return out


def _resume(rank, world, folder, frozen: bool, micro: int) -> dict:
    """Train, save, train on; a fresh model and optimizer load the checkpoint and train the same
    steps; a model loaded without the optimizer gets the saved values only."""
    out = {}
    model = z3.shard(_model(frozen))
    opt = _adam(model)
    _train(model, opt, rank, world, 0, micro=micro)
    path = os.path.join(folder, f"resume-{frozen}-{micro}")
    z3.save_checkpoint(path, model, opt)
    at_save = _params(model)
    full_path = os.path.join(folder, f"full-{frozen}-{micro}.pt")
    z3.save_full_state_dict(full_path, model)
    _train(model, opt, rank, world, STEPS, micro=micro)
    out["went_on"] = _params(model)
    fresh = z3.shard(_model(frozen, seed=99))
    fresh_opt = _adam(fresh)
    z3.load_checkpoint(path, fresh, fresh_opt)
    out["frozen_without_state"] = frozen and not any(
        p in fresh_opt.state and fresh_opt.state[p] for p in fresh[0].parameters()
    )
    _train(fresh, fresh_opt, rank, world, STEPS, micro=micro)
    out["resumes"] = _same(_params(fresh), _params(model)) and _same(
        _optim(fresh, fresh_opt), _optim(model, opt)
    )
    # the model only: the saved values, the optimizer untouched
    only = z3.shard(_model(frozen, seed=98))
    only_opt = _adam(only)
    z3.load_checkpoint(path, only)
    out["model_only"] = _same(_params(only), at_save) and not only_opt.state
    # the consolidated file (DeepSpeed's zero_to_fp32) loads strictly into the plain model
    plain = _model(frozen)
    plain.load_state_dict(torch.load(full_path, weights_only=True), strict=True)
    out["full_file"] = _same({n: p.detach() for n, p in plain.named_parameters()}, at_save)
    return out


def _inside_a_window(rank, world, folder, keep_gathered: bool) -> dict:
    """Save (and take the full state dict) between two micro-batches with sync off: training
    goes on as without the save; the checkpoint holds the last step's state."""
    out = {}
    runs = {}
    for saving in (False, True):
        model = z3.shard(_model())
        opt = _adam(model)
        _train(model, opt, rank, world, 0)
        before = (_params(model), _optim(model, opt))
        z3.set_requires_gradient_sync(model, False, keep_gathered=keep_gathered)
        _backward(model, rank, world, 100)
        if saving:
            path = os.path.join(folder, f"window-{keep_gathered}")
            out["save"] = _outcome(functools.partial(z3.save_checkpoint, path, model, opt))
            full = z3.full_state_dict(model)
            out["full_in_window"] = _same(full, before[0])
        z3.set_requires_gradient_sync(model, True)
        _backward(model, rank, world, 101)
        opt.step()
        opt.zero_grad()
        runs[saving] = (_params(model), _optim(model, opt))
    out["training_unchanged"] = _same(runs[True][0], runs[False][0]) and _same(
        runs[True][1], runs[False][1]
    )
    fresh = z3.shard(_model(seed=99))
    fresh_opt = _adam(fresh)
    z3.load_checkpoint(path, fresh, fresh_opt)
    out["holds_the_last_step"] = _same(_params(fresh), before[0]) and _same(
        _optim(fresh, fresh_opt), before[1]
    )
    return out


def _inside_gathered(rank, world, folder) -> dict:
    model = z3.shard(_model())
    with z3.gathered(model):
        error = _outcome(lambda: z3.save_checkpoint(os.path.join(folder, "gathered"), model))
    return {"error": error}


def _one_rank(rank, world, folder) -> dict:
    """At one rank: train, save, train on."""
    model = z3.shard(_model())
    opt = _adam(model)
    _train(model, opt, rank, world, 0)
    z3.save_checkpoint(os.path.join(folder, "one-rank"), model, opt)
    _train(model, opt, rank, world, STEPS)
    return _params(model)


def _from_one_rank(rank, world, folder) -> dict:
    model = z3.shard(_model(seed=99))
    opt = _adam(model)
    z3.load_checkpoint(os.path.join(folder, "one-rank"), model, opt)
    _train(model, opt, rank, world, STEPS)
    return _params(model)


def _all(rank, world, folder) -> dict:
    out = {"from_one_rank": _outcome(functools.partial(_from_one_rank, rank, world, folder))}
    dist.barrier()
    out["before_first_step"] = _outcome(lambda: _before_the_first_step(rank, world, folder))
    dist.barrier()
    for frozen, micro in ((False, 1), (True, 2)):
        out[("resume", frozen, micro)] = _outcome(
            functools.partial(_resume, rank, world, folder, frozen, micro)
        )
        dist.barrier()
    for kept in (False, True):
        out[("window", kept)] = _outcome(
            functools.partial(_inside_a_window, rank, world, folder, kept)
        )
        dist.barrier()
    out["gathered"] = _inside_gathered(rank, world, folder)
    return out


@functools.cache
def _folder_and_results() -> tuple[str, dict, list[dict]]:
    folder = tempfile.mkdtemp(prefix="zero3-ds-ckpt-")
    (one_rank,) = run_ranks(_one_rank, 1, folder, timeout=600)
    return folder, one_rank, run_ranks(_all, 2, folder, timeout=600)


def _results() -> list[dict]:
    return _folder_and_results()[2]


def _part(key) -> list[dict]:
    parts = [r[key] for r in _results()]
    for part in parts:
        assert isinstance(part, dict), part  # an error string: the scenario raised
    return parts


def _close(got: dict, want: dict) -> bool:
    # another world size sums the gradients in another order: equal up to rounding
    return got.keys() == want.keys() and all(rel_diff(got[k], want[k]) <= 1e-5 for k in want)


def test_a_checkpoint_saved_at_one_rank_resumes_at_two():
    _, one_rank, results = _folder_and_results()
    for r in results:
        assert isinstance(r["from_one_rank"], dict), r["from_one_rank"]
        assert _close(r["from_one_rank"], one_rank)


def test_a_checkpoint_saved_at_two_ranks_resumes_in_one_process_unsharded():
    """No process group, a plain model and optimizer: DCP reads the full tensors."""
    folder, _, _ = _folder_and_results()
    model = _model(seed=99)
    opt = _adam(model)
    z3.load_checkpoint(os.path.join(folder, "resume-False-1"), model, opt)
    for step in range(STEPS, 2 * STEPS):
        x, y = _batch(0, 1, 10 * step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for r in _part(("resume", False, 1)):
        assert _close(_params(model), r["went_on"])


def test_a_save_before_the_first_step_leaves_training_bit_identical():
    for r in _part("before_first_step"):
        assert r["state_after_save"] == 0  # the optimizer was not stepped to create its state
        assert r["training_unchanged"]


def test_a_checkpoint_saved_before_the_first_step_loads_as_a_fresh_optimizer():
    for r in _part("before_first_step"):
        assert r["fresh_state_after_load"] == 0
        assert r["fresh_resumes"]
        assert r["trained_resumes"]  # a trained optimizer's state goes back to none
        assert r["again_resumes"]
        assert r["offloaded"]


@pytest.mark.parametrize("frozen,micro", [(False, 1), (True, 2)])
def test_a_fresh_model_and_optimizer_resume_bit_identically(frozen, micro):
    for r in _part(("resume", frozen, micro)):
        assert r["resumes"]
        assert r["model_only"]
        assert r["full_file"]
        if frozen:
            assert r["frozen_without_state"]


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_a_save_inside_an_accumulation_window_changes_nothing_and_holds_the_last_step(
    keep_gathered,
):
    for r in _part(("window", keep_gathered)):
        assert r["save"] is None, r["save"]
        assert r["full_in_window"]
        assert r["training_unchanged"]
        assert r["holds_the_last_step"]


def test_a_save_inside_gathered_is_refused_naming_the_save():
    for r in _part("gathered"):
        assert r["error"] is not None and "zero3: save_checkpoint" in r["error"]
        assert "save after that block" in r["error"]
