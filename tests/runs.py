"""The multi-rank training runs the tests share: one process group per world size and codegen."""

from __future__ import annotations

import functools

from .dist_utils import run_ranks
from .training import run_jobs

EAGER = {"codegen": "eager"}
INDUCTOR = {"codegen": "inductor"}

# (model, optimizer, options, tag, train_pair kwargs); one process group per world and codegen
EAGER_JOBS = {
    1: [("gpt", "sgd", EAGER, "c", {}), ("mlp", "sgd", EAGER, "c", {})],
    2: [
        ("gpt", "sgd", EAGER, "c", {"check_inference": True, "analyze_graphs": True}),
        ("gpt", "sgd", {**EAGER, "reshard_after_forward": False}, "keep", {"analyze_graphs": True}),
        ("mlp", "sgd", EAGER, "c", {}),
        ("gpt", "adamw", EAGER, "c", {}),
        ("gpt_graph_break", "sgd", EAGER, "c", {}),
    ],
    3: [
        ("gpt", "sgd", EAGER, "c", {}),
        ("mlp", "sgd", EAGER, "c", {}),
        ("mlp", "adamw", EAGER, "c", {}),
        ("gpt", "sgd", None, "uncompiled", {}),
    ],
    4: [
        ("gpt", "sgd", EAGER, "c", {}),
        ("mlp", "sgd", EAGER, "c", {}),
        ("gpt", "adamw", EAGER, "c", {}),
    ],
}
INDUCTOR_JOBS = {
    2: [
        ("gpt", "sgd", INDUCTOR, "c", {"analyze_graphs": True}),
        ("gpt", "adamw", INDUCTOR, "c", {}),
        ("mlp", "sgd", INDUCTOR, "c", {}),
    ],
    3: [("gpt", "sgd", INDUCTOR, "c", {})],
}


@functools.cache
def results(world: int, codegen: str) -> dict:
    jobs = (EAGER_JOBS if codegen == "eager" else INDUCTOR_JOBS)[world]
    return run_ranks(run_jobs, world, jobs, timeout=900)
