"""Shrink a failing structure case: the smallest variant that still fails the same way.

``minimize(case, run)`` tries the variants ``shrink_candidates`` proposes (fewer ranks, the
eager codegen, default options, fewer steps, a plain output, a program step or a module, tie or
freeze less) and keeps the first that still fails with the same ``signature``, until none does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from .structure_cases import VALUE_ARGS, Case, Step, source
from .structure_runner import signature


def _without_step(case: Case, index: int) -> Case | None:
    """The case with program step ``index`` (value ``index + 1``) removed: its uses read its
    first input instead (or ``x``); later values renumbered."""
    removed = index + 1
    step = case.program[index]
    ints = [a for k, a in enumerate(step.args) if k in VALUE_ARGS[step.op] and a is not None]
    stand_in = ints[0] if ints else 0

    def remap(j):
        if j == removed:
            return stand_in
        return j - 1 if j > removed else j

    def remap_step(s: Step) -> Step:
        values = VALUE_ARGS[s.op]
        return Step(
            s.op,
            tuple(
                remap(a) if k in values and isinstance(a, int) else a for k, a in enumerate(s.args)
            ),
        )

    def remap_output(o):
        if o[0] == "value":
            return ("value", remap(o[1]))
        if o[0] == "const":
            return o
        return (o[0], *[remap_output(x) for x in o[1:]])

    program = tuple(remap_step(s) for k, s in enumerate(case.program) if k != index)
    loss_values = tuple(dict.fromkeys(remap(j) for j in case.loss_values))
    return replace(case, program=program, output=remap_output(case.output), loss_values=loss_values)


def _referenced(case: Case) -> str:
    return " ".join(
        [repr(case.program), repr(case.ties), repr(case.frozen)]
        + [repr(m) for _, m in case.tree]  # refs inside the tree
    )


def shrink_candidates(case: Case) -> Iterator[Case]:
    """Smaller variants of ``case``, the most promising first."""
    if case.world > 1:
        yield replace(case, world=case.world - 1)
    options = dict(case.options)
    if options.get("codegen") == "inductor":
        yield replace(case, options=tuple({**options, "codegen": "eager"}.items()))
    for name in options:
        if name != "codegen":
            yield replace(case, options=tuple((k, v) for k, v in case.options if k != name))
    if case.micro_batches > 1:
        yield replace(case, micro_batches=1, keep_gathered=False, plain_accumulation=False)
    if case.keep_gathered:
        yield replace(case, keep_gathered=False)
    if case.ragged:
        yield replace(case, ragged=False)
    if case.inference:
        yield replace(case, inference=False)
    if case.steps > 1:
        yield replace(case, steps=case.steps - 1)
    if case.optimizer != "sgd":
        yield replace(case, optimizer="sgd")
    main = case.loss_values[0]
    if case.output != ("value", main) or len(case.loss_values) > 1:
        yield replace(case, output=("value", main), loss_values=(main,))
    for index in reversed(range(len(case.program))):
        yield _without_step(case, index)
    for k in range(len(case.ties)):
        yield replace(case, ties=case.ties[:k] + case.ties[k + 1 :])
    for k in range(len(case.frozen)):
        yield replace(case, frozen=case.frozen[:k] + case.frozen[k + 1 :])
    used = _referenced(case)
    for k, (name, _) in enumerate(case.tree):
        if f"self.{name}" not in used:
            yield replace(case, tree=case.tree[:k] + case.tree[k + 1 :])


def minimize(
    case: Case, run: Callable[[Case], dict[str, Any]], budget: int = 60
) -> tuple[Case, dict[str, Any], int]:
    """Greedy shrinking: take the first smaller variant that still fails the same way, until
    none does or ``budget`` runs are spent. Returns (case, its result, runs used)."""
    result = run(case)
    wanted = signature(result)
    runs = 1
    progress = True
    while progress and runs < budget:
        progress = False
        for candidate in shrink_candidates(case):
            if runs >= budget:
                break
            try:
                source(candidate)
            except Exception:  # noqa: BLE001 (a variant the renderer cannot express)
                continue
            outcome = run(candidate)
            runs += 1
            if outcome["status"] not in ("ok", "invalid") and signature(outcome) == wanted:
                case, result, progress = candidate, outcome, True
                break
    return case, result, runs
