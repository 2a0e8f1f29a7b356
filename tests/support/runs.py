"""The multi-rank training runs the tests share: one process group per world size and codegen."""

from __future__ import annotations

import functools

from .dist_utils import run_ranks
from .training import run_jobs

EAGER = {"codegen": "eager"}
INDUCTOR = {"codegen": "inductor"}

# scheduling options that change the graphs; each must train exactly like eager
OPTION_COMBOS = [
    {"prefetch_depth": 0},
    {"prefetch_depth": 2, "reduce_scatter_depth": 2, "bucket_mb": 0.002},
    {"bucket_mb": 0.0005},  # about one parameter per collective
    {"prefetch_depth": 3, "max_inflight_bytes": 8192, "bucket_mb": 0.004},
]

# (model, optimizer, options, tag, train_pair kwargs)
EAGER_JOBS = {
    1: [("gpt", "sgd", EAGER, "c", {}), ("mlp", "sgd", EAGER, "c", {})],
    2: [
        ("gpt", "sgd", EAGER, "c", {"check_inference": True, "analyze_graphs": True}),
        ("gpt", "sgd", {**EAGER, "reshard_after_forward": False}, "keep", {"analyze_graphs": True}),
        ("mlp", "sgd", EAGER, "c", {}),
        ("gpt", "adamw", EAGER, "c", {}),
        ("gpt_graph_break", "sgd", EAGER, "c", {}),
        *[
            ("gpt", "sgd", {**EAGER, **combo}, f"option{i}", {})
            for i, combo in enumerate(OPTION_COMBOS)
        ],
        ("gpt", "sgd", {**EAGER, "fused_copies": True}, "fused", {}),
    ],
    3: [
        ("gpt", "sgd", EAGER, "c", {}),
        ("mlp", "sgd", EAGER, "c", {}),
        ("mlp", "adamw", EAGER, "c", {}),
        ("gpt", "sgd", None, "uncompiled", {}),
        ("gpt", "sgd", EAGER, "clip", {"clip_norm": 0.5}),
    ],
    4: [
        ("gpt", "sgd", EAGER, "c", {}),
        ("mlp", "sgd", EAGER, "c", {}),
    ],
}
INDUCTOR_JOBS = {
    2: [
        ("gpt", "sgd", INDUCTOR, "c", {"analyze_graphs": True, "profile_step": True}),
        # its inference graph (no_grad) is one Inductor's post-grad passes treat differently
        (
            "mlp",
            "sgd",
            {**INDUCTOR, **OPTION_COMBOS[1]},
            "option1",
            {"check_inference": True, "analyze_graphs": True},
        ),
        # the copy-in/copy-out spliced as ATen ops, for Inductor to fuse (uneven: 17 rows -> 9, 8)
        ("mlp", "sgd", {**INDUCTOR, **OPTION_COMBOS[1], "fused_copies": True}, "fused", {}),
    ],
    # uneven shards (17, 13, 5 rows over 3 ranks) and about one parameter per collective
    3: [("mlp", "sgd", {**INDUCTOR, **OPTION_COMBOS[2]}, "option2", {})],
}


def _world(world: int) -> list[dict]:
    """One process group per world size runs its eager and inductor jobs; its result, or its
    failure, is kept for every test that reads it (a failed world is not run again per test)."""
    outcome = _world_outcome(world)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


@functools.cache
def _world_outcome(world: int) -> list[dict] | BaseException:
    jobs = [
        (model, optimizer, options, f"{codegen}:{tag}", kwargs)
        for codegen, table in (("eager", EAGER_JOBS), ("inductor", INDUCTOR_JOBS))
        for model, optimizer, options, tag, kwargs in table.get(world, [])
    ]
    try:
        return run_ranks(run_jobs, world, jobs, timeout=1200)
    except Exception as error:  # noqa: BLE001  (re-raised by every reader)
        return error


def results(world: int, codegen: str) -> list[dict]:
    """Per rank: {"model/optimizer/tag": train_pair result} of the ``codegen`` jobs."""
    marker = f"/{codegen}:"
    return [
        {key.replace(marker, "/"): value for key, value in per_rank.items() if marker in key}
        for per_rank in _world(world)
    ]
