"""Gradient accumulation over micro-batches, with and without a reduce-scatter on each."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import zero3_compile as z3
from zero3_compile.compiler.recording import record_graphs
from zero3_compile.sharding.state import state_of

from ..support.dist_utils import run_scenarios
from ..support.graph_checks import collective_counts
from ..support.runs import OPTION_COMBOS
from ..support.training import PER_RANK_BATCH, build, rel_diff

MICRO_STEPS = 3


def _accumulate(rank, world_size, model_name, codegen, sync_each_step):
    torch._dynamo.reset()  # each scenario compiles its own graphs (they are recorded)
    model, loss_fn, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    z3.shard(model)
    # the options of an equivalence run: its compiled graphs are in Inductor's cache already
    options = {"codegen": codegen, **(OPTION_COMBOS[1] if codegen == "inductor" else {})}
    step = torch.compile(model, backend="zero3", options=options)
    counts = []
    for micro in range(MICRO_STEPS):
        inputs, targets = make_batch(world_size * PER_RANK_BATCH, seed=micro)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        last = micro == MICRO_STEPS - 1
        if not sync_each_step:
            z3.set_requires_gradient_sync(model, last)
        with record_graphs() as records:
            loss_fn(step, (inputs[mine], targets[mine])).backward()
        counts.append([collective_counts(r.gm) for r in records if r.kind == "backward"])
        loss_fn(reference, (inputs, targets)).backward()
    params = dict(model.named_parameters())
    sinks_left = [
        n
        for n, p in params.items()
        if state_of(p).grad_sink is not None and state_of(p).grad_sink.grad is not None
    ]
    return {
        "grads": {
            n: p.grad.full_tensor() if p.grad is not None else None for n, p in params.items()
        },
        "ref_grads": {n: p.grad for n, p in reference.named_parameters()},
        "backward_counts": counts,
        "sinks_left": sinks_left,
    }


SCENARIOS = [
    ("gpt", "eager", True),
    ("gpt", "eager", False),
    ("mlp", "inductor", False),
    # parameters whose gradient may be absent (gated) while sync is off: the gradient must reach
    # their sinks, never the shards (a full-size plain gradient in .grad before the fix)
    ("two_outputs", "eager", False),
]


@functools.cache
def _scenarios():
    return run_scenarios(_accumulate, 2, SCENARIOS)


def results(model_name, codegen, sync_each_step):
    return _scenarios()[(model_name, codegen, sync_each_step)]


@pytest.mark.parametrize("model_name,codegen,sync_each_step", SCENARIOS)
def test_accumulated_gradients_match_the_whole_batch(model_name, codegen, sync_each_step):
    for r in results(model_name, codegen, sync_each_step):
        for name, want in r["ref_grads"].items():
            got = r["grads"][name]
            if want is None:
                assert got is None
                continue
            assert rel_diff(got, want) <= (1e-5 if codegen == "eager" else 1e-4), name
        assert r["sinks_left"] == []  # the pending full gradients were flushed and freed


def test_without_sync_backward_issues_no_reduce_scatter():
    for r in results("gpt", "eager", False):
        compiled = [c for step in r["backward_counts"] for c in step]
        # the first micro-step compiles the no-sync backward, the last the synchronised one
        assert compiled[0]["reduce_scatter"] == 0 and compiled[0]["all_gather"] > 0
        assert compiled[-1]["reduce_scatter"] > 0


def _accumulate_as_on_torch_2_11(rank, world_size, model_name, codegen, sync_each_step):
    """``_accumulate`` with the shard reads torch 2.11 needs (``_torch.dtensor.local_shard``: its
    ``DTensor.to_local()`` turns a missing gradient into zeros, which AccumulateGrad then adds to
    the pending gradient of sync-off micro-batches), forced on whatever torch runs."""
    from zero3_compile._torch import dtensor, dynamo

    rewritten = []
    # the pipeline's rewrite_to_local pass calls dynamo.rewrite_to_local
    probe, rewrite = dtensor.to_local_keeps_missing_gradients, dynamo.rewrite_to_local
    dtensor.to_local_keeps_missing_gradients = lambda: False
    dynamo.rewrite_to_local = lambda *args: rewritten.append(rewrite(*args))
    try:
        out = _accumulate(rank, world_size, model_name, codegen, sync_each_step)
    finally:
        dtensor.to_local_keeps_missing_gradients, dynamo.rewrite_to_local = probe, rewrite
    return {**out, "rewritten": rewritten}


def test_shard_reads_of_torch_2_11_keep_missing_gradients_missing():
    """The traced shard reads of torch 2.11 (``_torch.dynamo.rewrite_to_local`` in the dynamo graph,
    before AOTAutograd: the same for either codegen): sync-off accumulation, where no gradient
    reaches the shard, gives the whole batch's gradients (zeros instead would raise: they are
    added to a pending gradient). The eager reads (``_torch.dtensor.local_shard`` in the getters) are
    proved on 2.11 itself, by the uncompiled mixture-of-experts test."""
    scenario = ("gpt", "eager", False)
    for r in run_scenarios(_accumulate_as_on_torch_2_11, 2, [scenario])[scenario]:
        assert r["rewritten"] and all(r["rewritten"])  # every graph reads shards as on 2.11
        for name, want in r["ref_grads"].items():
            got = r["grads"][name]
            assert (got is None) == (want is None), name
            if want is not None:
                assert rel_diff(got, want) <= 1e-5, name
        assert r["sinks_left"] == []


# ------------------------------------------------ requires_grad toggled within and between steps

# Optimizer steps, each a list of micro-batches; sync is off for every micro-batch but a step's
# last. A micro-batch names the layers frozen (requires_grad=False) for it, "-b" when it does
# not use layer b, "o" when the model also returns layer d's output, which the loss does not
# read, and "o0" when only rank 0's loss reads it. Odd steps freeze before turning sync back on,
# even ones after.
SCHEDULE = [
    ["b", ""],  # frozen in a sync-off micro-batch, trained in the synced one: only that counts
    ["", "b"],  # trained, then frozen (before sync is on): the first counts
    ["", "b"],  # the same, frozen after sync is on
    ["a", "", "a"],
    ["", "ab", ""],
    ["", "-b"],  # used, then not used by the synced micro-batch: the first counts
    ["a"],  # frozen for whole steps, then trained again: recompiles
    ["a", "a"],
    ["", ""],
    ["c"],
    [""],
    # d feeds only an output the loss does not read: no gradient, as in eager (kept gathered, it
    # ended the window with zeros, and AdamW's weight decay moved it)
    ["o", "o", "o"],
    ["o", "o0", "o"],  # compiled: one rank's loss reaches d, the others reduce zeros with it
]


class _Toggled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b, self.c = (
            torch.nn.Linear(6, 8),
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 3),
        )
        self.d = torch.nn.Linear(6, 2)  # steps 11, 12: an output the loss ignores (but one rank's)

    def forward(self, x, use_b: bool = True, side: bool = False):
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return (self.c(h), self.d(x)) if side else self.c(h)


def _set_frozen(model, micro_batch: str) -> None:
    for name in "abc":
        for p in getattr(model, name).parameters():
            p.requires_grad_(name not in micro_batch.replace("-b", ""))


def _toggle(rank, world_size, compiled, keep_gathered):
    """Train the sharded model and its single-process twin through ``SCHEDULE``."""
    torch._dynamo.reset()
    model = _Toggled()
    reference = copy.deepcopy(model)
    z3.shard(model)
    options = {"codegen": "eager"}
    step_model = torch.compile(model, backend="zero3", options=options) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    out = {"grads": [], "ref_grads": [], "params": [], "ref_params": []}
    # each frozen set and sync state is a variant: all of them compiled, none run uncompiled
    with torch._dynamo.config.patch(recompile_limit=32), record_graphs() as records:
        for s, micro_batches in enumerate(SCHEDULE):
            for k, micro_batch in enumerate(micro_batches):
                last = k == len(micro_batches) - 1
                if s % 2:
                    _set_frozen(model, micro_batch)
                if len(micro_batches) > 1 and (k == 0 or last):
                    kept = keep_gathered and not last
                    z3.set_requires_gradient_sync(model, last, keep_gathered=kept)
                _set_frozen(model, micro_batch)
                _set_frozen(reference, micro_batch)
                gen = torch.Generator().manual_seed(100 * s + k)
                x = torch.randn(world_size * PER_RANK_BATCH, 6, generator=gen)
                y = torch.randn(world_size * PER_RANK_BATCH, 3, generator=gen)
                use_b, side = "-b" not in micro_batch, "o" in micro_batch
                out_mine, out_ref = step_model(x[mine], use_b, side), reference(x, use_b, side)
                loss, ref_loss = 0, 0
                # rank 0's rows, averaged over the ranks; compiled only (uncompiled, zero3
                # reduces each gradient where it arises: rank-dependent use mismatches)
                if "o0" in micro_batch and compiled:
                    loss = out_mine[1].sum() if rank == 0 else 0
                    ref_loss = out_ref[1][:PER_RANK_BATCH].sum() / world_size
                if side:
                    out_mine, out_ref = out_mine[0], out_ref[0]
                (F.mse_loss(out_mine, y[mine]) + loss).backward()
                (F.mse_loss(out_ref, y) + ref_loss).backward()
            params = dict(model.named_parameters())
            out["grads"].append(
                {n: None if p.grad is None else p.grad.full_tensor() for n, p in params.items()}
            )
            out["ref_grads"].append({n: p.grad for n, p in reference.named_parameters()})
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            out["params"].append({n: p.full_tensor() for n, p in params.items()})
            out["ref_params"].append(
                {n: p.detach().clone() for n, p in reference.named_parameters()}
            )
    out["forward_graphs"] = sum(r.kind == "forward" for r in records)
    return out


TOGGLE_SCENARIOS = [(False, False), (False, True), (True, False), (True, True)]


@functools.cache
def _toggles():
    return run_scenarios(_toggle, 2, TOGGLE_SCENARIOS)


@pytest.mark.parametrize("compiled,keep_gathered", TOGGLE_SCENARIOS)
def test_requires_grad_toggled_between_micro_batches_and_steps_trains_like_eager(
    compiled, keep_gathered
):
    """A parameter frozen for a micro-batch gets no gradient from it, one frozen (or unused) in
    the synced micro-batch keeps the earlier ones' (the step used to refuse), layers frozen
    for whole steps train again when unfrozen, and one feeding only an output the loss ignores
    gets none (AdamW's weight decay leaves it as it is): gradients and parameters equal eager's."""
    for r in _toggles()[(compiled, keep_gathered)]:
        for s, (grads, want) in enumerate(zip(r["grads"], r["ref_grads"])):
            for name, value in want.items():
                got = grads[name]
                assert (got is None) == (value is None), (s, name)
                if value is not None:
                    assert rel_diff(got, value) <= 1e-5, (s, name)
        for s, (params, want) in enumerate(zip(r["params"], r["ref_params"])):
            for name, value in want.items():
                assert rel_diff(params[name], value) <= 1e-5, (s, name)
        # one graph per frozen set and sync state (past dynamo's default limit of 8)
        assert r["forward_graphs"] >= (9 if compiled else 0)
