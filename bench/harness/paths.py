"""Where the benchmark scripts write by default: outside the source tree.

Reports, JSON, charts and logs (and big_model.py's checkpoints and offload scratch files) go
under ``$ZERO3_BENCH_RESULTS`` when it is set, else under ``~/.cache/zero3_compile/bench``
(``$XDG_CACHE_HOME`` respected). Each script's ``--out`` still overrides it. Published results
live on the ``bench-results`` branch (bench/README.md says how they get there).
"""

from __future__ import annotations

import os

RESULTS_ENV = "ZERO3_BENCH_RESULTS"


def results_dir(*parts: str) -> str:
    """The folder a script writes under by default, ``parts`` joined below the results root.

    Example:
        >>> os.environ["ZERO3_BENCH_RESULTS"] = "/tmp/runs"
        >>> results_dir("big", "checkpoints")
        '/tmp/runs/big/checkpoints'
    """
    root = os.environ.get(RESULTS_ENV)
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "zero3_compile", "bench")
    return os.path.join(root, *parts)
