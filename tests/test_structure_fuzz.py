"""A fixed-seed slice of the model-structure fuzzer: random module trees and forward programs
trained with zero3 against single-process eager (losses, gradients and ``grad is None``, the
outputs' non-tensor parts, final parameters).

The cases come from ``structure_cases.py``'s hypothesis strategy with fixed seeds; each world
size runs its cases in one process launch (``structure_runner.RankPool``). The nightly size is
``python -m bench.fuzz_structures --cases 300``. A failure prints the case as a standalone module
and the command that replays it (and shrinks it to a minimal reproducer).
"""

from __future__ import annotations

import functools

import pytest

from .structure_cases import draw_cases, source, walk

# world size -> (seed, cases, how many of them compile with Inductor)
SLICE = {1: (101, 4, 0), 2: (102, 8, 1), 3: (103, 4, 0)}


@functools.cache
def _cases(world: int):
    seed, count, inductor = SLICE[world]
    return draw_cases(count, seed, worlds=(world,), inductor=inductor)


@functools.cache
def _results(world: int):
    from .structure_runner import CaseRunner

    runner = CaseRunner()
    try:
        return [runner(case) for case in _cases(world)]
    finally:
        runner.close()


PARAMS = [(world, index) for world, (_, count, _) in SLICE.items() for index in range(count)]


@pytest.mark.parametrize("world,index", PARAMS, ids=[f"world{w}-case{i}" for w, i in PARAMS])
def test_random_structure_trains_like_eager(world, index):
    case = _cases(world)[index]
    result = _results(world)[index]
    assert result["status"] in ("ok", "invalid"), (
        f"{result['status']}: {result['detail']}\n{result.get('traceback', '')}\n"
        f"{source(case)}\n"
        f"replay: python -m bench.fuzz_structures --replay '{case.to_json()}'"
    )


def test_the_slice_draws_every_kind_of_structure():
    """The slice is not a trivial one: the features the fuzzer exists for occur in it."""
    drawn = [case for world in SLICE for case in _cases(world)]
    ops = {step.op for case in drawn for step in case.program}
    kinds = {mod.kind for case in drawn for _, mod in walk(case.tree)}
    assert {"call", "inplace", "view", "param"} <= ops, ops
    assert {"list", "dict", "seq"} <= kinds, kinds
    assert any(case.frozen for case in drawn) and any(case.micro_batches > 1 for case in drawn)
    assert any(case.output[0] != "value" for case in drawn)
    assert sum(case.codegen == "inductor" for case in drawn) == 1
