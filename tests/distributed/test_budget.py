"""The memory budget (``memory_budget_mb``) and parameters kept gathered over accumulation.

Every budget trains like eager single-process training; a larger budget never costs more
collectives or gathered bytes; the plan's estimate fits the budget and agrees with a measured
run; too small a budget is refused with the minimum. ``keep_gathered`` accumulation runs its
micro-batches without collectives and still matches the whole batch.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import zero3_compile as z3
from zero3_compile._torch.c10d import ALL_GATHER
from zero3_compile.compiler.recording import record_graphs
from zero3_compile.inspect import measure_peak_bytes

from ..support.dist_utils import run_ranks
from ..support.graph_checks import collective_counts
from ..support.models import GPT, FrozenMLP, GPTConfig, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from ..support.training import rel_diff

# parameters large enough against the activations for the budget to choose between them
CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=3, n_head=4, n_embd=160)
TOLERANCE = {"eager": 1e-5, "inductor": 1e-4}
MiB = 2**20


def _gathered_bytes(records) -> int:
    return sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for r in records
        for n in r.gm.graph.nodes
        if n.target is ALL_GATHER
    )


def _train(rank, world, build, loss_fn, make_batch, options, steps=3, micro=1):
    """zero3 (each rank its slice) against the whole batch; returns the plan and the figures."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    z3.shard(model)
    step = torch.compile(model, backend="zero3", options=options)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(
        [p for p in reference.parameters() if p.requires_grad], lr=0.05, momentum=0.9
    )
    out = {"collectives": None}
    for i in range(steps):
        for k in range(micro):
            inputs, targets = make_batch(2 * world, seed=10 * i + k)
            mine = slice(2 * rank, 2 * rank + 2)
            if micro > 1:
                z3.set_requires_gradient_sync(model, k == micro - 1)
            with record_graphs() as records:
                (loss_fn(step, (inputs[mine], targets[mine])) / micro).backward()
            if i == 0 and k == micro - 1:
                counts = [collective_counts(r.gm) for r in records]
                out["collectives"] = {
                    kind: sum(c.get(kind, 0) for c in counts)
                    for kind in ("all_gather", "reduce_scatter")
                }
                out["backward_gathers"] = sum(
                    collective_counts(r.gm).get("all_gather", 0)
                    for r in records
                    if r.kind == "backward"
                )
                out["gathered_bytes"] = _gathered_bytes(records)
                plans = [r.budget for r in records if r.budget is not None]
                out["plan"] = plans[0].to_dict() if plans else None
            (loss_fn(reference, (inputs, targets)) / micro).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = z3.full_state_dict(model)
    out["param_diff"] = max(rel_diff(full[k], v) for k, v in reference.state_dict().items())
    return out


def _gpt():
    return GPT(CONFIG)


def _gpt_batch(n, seed):
    return gpt_batch(n, CONFIG, seed=seed)


def _sweep(rank, world):
    """Budgets from pure ZeRO-3's minimum to everything kept, and the companions."""
    out = {}
    # the whole budget: its plan tells the minimum and the cost of keeping everything
    top = _train(
        rank, world, _gpt, gpt_loss, _gpt_batch, {"codegen": "eager", "memory_budget_mb": 1e6}
    )
    minimum, everything = top["plan"]["minimum"], top["plan"]["estimated"]
    budgets = {
        "minimum": minimum / MiB,
        "half": (minimum + (everything - minimum) / 2) / MiB,
        "everything": everything / MiB,
    }
    out["none"] = _train(rank, world, _gpt, gpt_loss, _gpt_batch, {"codegen": "eager"})
    for name, mb in budgets.items():
        out[name] = _train(
            rank, world, _gpt, gpt_loss, _gpt_batch, {"codegen": "eager", "memory_budget_mb": mb}
        )
    out["budgets"] = budgets
    out["inductor-half"] = _train(
        rank,
        world,
        _gpt,
        gpt_loss,
        _gpt_batch,
        {"codegen": "inductor", "memory_budget_mb": budgets["half"]},
    )
    out["accumulate-half"] = _train(
        rank,
        world,
        _gpt,
        gpt_loss,
        _gpt_batch,
        {"codegen": "eager", "memory_budget_mb": budgets["half"]},
        steps=2,
        micro=2,
    )
    # frozen parameters (FrozenMLP): no gradient, still planned
    mlp_top = _train(
        rank, world, FrozenMLP, mlp_loss, mlp_batch, {"codegen": "eager", "memory_budget_mb": 1e6}
    )
    plan = mlp_top["plan"]
    out["frozen-half"] = _train(
        rank,
        world,
        FrozenMLP,
        mlp_loss,
        mlp_batch,
        {"codegen": "eager", "memory_budget_mb": (plan["minimum"] + plan["estimated"]) / 2 / MiB},
    )
    out["frozen-top"] = mlp_top
    # too small: refused with the minimum
    try:
        _train(
            rank,
            world,
            _gpt,
            gpt_loss,
            _gpt_batch,
            {"codegen": "eager", "memory_budget_mb": minimum / MiB / 2},
            steps=1,
        )
        out["too_small"] = None
    except Exception as error:  # noqa: BLE001 - dynamo wraps the backend's error
        out["too_small"] = f"{type(error).__name__}: {error}"
    return out


@functools.cache
def sweep():
    return run_ranks(_sweep, 2, timeout=900)


ORDER = ["minimum", "half", "everything"]


@pytest.mark.parametrize(
    "key",
    ["none", *ORDER, "inductor-half", "accumulate-half", "frozen-half", "frozen-top"],
)
def test_every_budget_trains_like_eager(key):
    for r in sweep():
        codegen = "inductor" if key.startswith("inductor") else "eager"
        assert r[key]["param_diff"] <= TOLERANCE[codegen], (key, r[key]["param_diff"])


def test_a_larger_budget_never_costs_more_collectives_or_gathered_bytes():
    for r in sweep():
        kept = [len(r[k]["plan"]["kept"]) for k in ORDER]
        gathers = [r[k]["collectives"]["all_gather"] for k in ORDER]
        gathered = [r[k]["gathered_bytes"] for k in ORDER]
        assert kept == sorted(kept) and gathers == sorted(gathers, reverse=True), (kept, gathers)
        assert gathered == sorted(gathered, reverse=True), gathered
        # the ends: the minimum peaks as pure ZeRO-3 does (what it keeps costs nothing at the
        # step's peak: with one gloo collective in flight the peak is where no kept parameter
        # is alive), the whole budget keeps every parameter and gathers nothing in backward
        # (reshard_after_forward=False's schedule, whose graphs tests/distributed/test_partition.py checks)
        assert r["minimum"]["collectives"] == r["none"]["collectives"]
        assert r["minimum"]["plan"]["estimated"] <= r["minimum"]["plan"]["minimum"]
        assert r["minimum"]["gathered_bytes"] <= r["none"]["gathered_bytes"]
        assert r["none"]["backward_gathers"] > 0
        assert r["everything"]["backward_gathers"] == 0
        assert len(r["everything"]["plan"]["kept"]) == r["everything"]["plan"]["candidates"]
        assert 0 < len(r["half"]["plan"]["kept"]) < r["half"]["plan"]["candidates"]
        assert r["half"]["gathered_bytes"] < r["none"]["gathered_bytes"]


def test_the_plan_fits_its_budget_and_says_what_one_more_would_cost():
    for r in sweep():
        for key in ORDER:
            plan = r[key]["plan"]
            assert plan["estimated"] <= plan["budget"], (key, plan)
            assert plan["minimum"] <= plan["estimated"]
            if plan["next_estimate"] is not None:
                assert plan["next_estimate"] > plan["budget"]
        assert r["frozen-top"]["plan"]["kept"]  # frozen parameters are kept too


def test_too_small_a_budget_is_refused_with_the_minimum():
    for r in sweep():
        message = r["too_small"]
        assert message is not None and "BudgetError" in message
        assert (
            "below what this graph needs" in message and "Raise the budget to at least" in message
        )
        minimum = r["budgets"]["minimum"]
        assert f"at least {int(-(-minimum // 1))}" in message


def test_accumulation_with_a_budget_reduces_once_per_step():
    for r in sweep():
        assert r["accumulate-half"]["collectives"]["reduce_scatter"] > 0


# ---------------------------------------------------------------- estimate against a real run

PEAK_CONFIG = CONFIG
# small buckets: gloo's collective temporaries, whose lifetimes depend on timing, stay a small part
# of the peak (the estimate holds each until its wait: an upper bound)
PEAK_OPTIONS = {"codegen": "eager", "bucket_mb": 0.25}


def _estimate_and_measure(rank, world):
    """The whole budget (every parameter kept), then half way from the minimum to it."""
    torch.manual_seed(0)
    model = z3.shard(GPT(PEAK_CONFIG))

    def train_step(idx, targets):  # the loss inside the compiled graph, as in a training step
        return gpt_loss(model, (idx, targets))

    idx, targets = gpt_batch(4, PEAK_CONFIG)
    everything, top = _measure(model, train_step, idx, targets, 1e6)
    half, _ = _measure(model, train_step, idx, targets, (top.minimum + top.estimated) / 2 / MiB)
    return {"everything": everything, "half": half}


def _measure(model, train_step, idx, targets, budget_mb: float):
    """Compile ``train_step`` under ``budget_mb``; its plan, explain's estimate, a measured step."""
    torch._dynamo.reset()
    step = torch.compile(
        train_step, backend="zero3", options={**PEAK_OPTIONS, "memory_budget_mb": budget_mb}
    )
    for p in model.parameters():
        p.grad = None
    with record_graphs() as records:
        step(idx, targets).backward()
    plan = [r.budget for r in records if r.budget is not None][0]
    report = z3.explain(step, idx, targets, loss_fn=lambda loss: loss)
    peaks = []
    for _ in range(3):  # the least of three: gloo's worker temporaries overlap by timing
        for p in model.parameters():
            p.grad = None
        peaks.append(measure_peak_bytes(lambda: step(idx, targets).backward())[0])
    figures = {
        "planned_peak": plan.estimated - plan.persistent,
        "report_peak": report.estimated_step_peak_bytes,
        "measured_peak": min(peaks),
        "kept": sorted(plan.kept_names),
        "text": str(report),
    }
    return figures, plan


@functools.cache
def peaks():
    return run_ranks(_estimate_and_measure, 2, timeout=600)


def test_the_plans_estimate_agrees_with_the_compiled_graphs_and_a_measured_run():
    for r in peaks():
        for name, figures in r.items():
            assert figures["kept"], name
            # the plan estimated the very schedule that was compiled
            assert figures["planned_peak"] == figures["report_peak"], (name, figures)
            measured = figures["measured_peak"]
            assert abs(figures["planned_peak"] - measured) <= 0.15 * measured, (name, figures)


def test_explain_reports_the_budget_and_the_kept_parameters():
    for r in peaks():
        text = r["half"]["text"]
        assert "memory budget" in text and "kept gathered from forward to backward" in text
        for name in r["half"]["kept"]:
            assert name in text


# ---------------------------------------------------------------- keep_gathered accumulation

MICRO = 3


def _keep_gathered(rank, world, model_name, codegen, precision):
    torch._dynamo.reset()
    torch.manual_seed(1234)
    if model_name == "gpt":
        model, loss_fn, make_batch = GPT(), gpt_loss, gpt_batch
    else:
        model, loss_fn, make_batch = FrozenMLP(), mlp_loss, mlp_batch
    reference = copy.deepcopy(model)
    twin = copy.deepcopy(model)
    dtype = torch.bfloat16 if precision == "bf16" else None
    z3.shard(model, param_dtype=dtype)
    step = torch.compile(model, backend="zero3", options={"codegen": codegen})
    # bf16 compute differs from the fp32 reference by bf16's rounding: kept-gathered
    # accumulation must be as close to it as the usual accumulation (the twin) is
    z3.shard(twin, param_dtype=dtype)
    twin_step = torch.compile(twin, backend="zero3", options={"codegen": codegen})
    out = {"counts": [], "diffs": [], "twin_diffs": []}
    for cycle in range(2):
        z3.set_requires_gradient_sync(model, False, keep_gathered=True)
        counts = []
        for micro in range(MICRO):
            inputs, targets = make_batch(2 * world, seed=10 * cycle + micro)
            mine = slice(2 * rank, 2 * rank + 2)
            if micro == MICRO - 1:
                z3.set_requires_gradient_sync(model, True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss_fn(step, (inputs[mine], targets[mine])).backward()
            # every collective, the cross-rank guard's included, runs on gloo
            counts.append(sum(1 for e in prof.events() if e.name.startswith("gloo:")))
            z3.set_requires_gradient_sync(twin, micro == MICRO - 1)
            loss_fn(twin_step, (inputs[mine], targets[mine])).backward()
            loss_fn(reference, (inputs, targets)).backward()
        for copy_, key in ((model, "diffs"), (twin, "twin_diffs")):
            grads = {n: p.grad for n, p in copy_.named_parameters()}
            diffs = []
            for name, want in reference.named_parameters():
                if want.grad is None:
                    assert grads[name] is None, name
                    continue
                diffs.append(rel_diff(grads[name].full_tensor(), want.grad))
            out[key].append(max(diffs))
        out["counts"].append(counts)
        # all three continue from the reference's update: the cycles stay comparable
        with torch.no_grad():
            for q in reference.parameters():
                if q.grad is not None:
                    q.add_(q.grad, alpha=-0.05)
        for copy_ in (model, twin, reference):
            for p in copy_.parameters():
                p.grad = None
        z3.load_full_state_dict(model, reference.state_dict())
        z3.load_full_state_dict(twin, reference.state_dict())
    # stepping with gradients pending unreduced is refused
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    z3.set_requires_gradient_sync(model, False, keep_gathered=True)
    inputs, targets = make_batch(2 * world, seed=99)
    loss_fn(step, (inputs[:2], targets[:2])).backward()
    try:
        opt.step()
        out["step_error"] = None
    except RuntimeError as error:
        out["step_error"] = str(error)
    z3.set_requires_gradient_sync(model, True)
    opt.step()  # reduced now: allowed
    return out


KEEP_SCENARIOS = [("gpt", "eager", "fp32"), ("mlp", "inductor", "fp32"), ("gpt", "eager", "bf16")]


@functools.cache
def keep_results():
    from ..support.dist_utils import run_scenarios

    return run_scenarios(_keep_gathered, 2, KEEP_SCENARIOS)


@pytest.mark.parametrize("model_name,codegen,precision", KEEP_SCENARIOS)
def test_keep_gathered_accumulation_matches_the_whole_batch_without_collectives(
    model_name, codegen, precision
):
    for r in keep_results()[(model_name, codegen, precision)]:
        if precision == "bf16":
            for kept, usual in zip(r["diffs"], r["twin_diffs"]):
                assert kept <= 1.5 * usual, (r["diffs"], r["twin_diffs"])
        else:
            assert max(r["diffs"]) <= TOLERANCE[codegen], r["diffs"]
        for counts in r["counts"]:
            # kept micro-batches: no collective at all; the synchronised one: the usual schedule
            assert counts[: MICRO - 1] == [0] * (MICRO - 1) and counts[-1] > 0, counts
        assert r["step_error"] is not None and "set_requires_gradient_sync" in r["step_error"]
