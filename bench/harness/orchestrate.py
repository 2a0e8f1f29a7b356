"""Parent side of one run: environment, a fresh Inductor cache, the processes, the summary."""

from __future__ import annotations

import os
import shutil
import tempfile

from . import report
from .contenders import CONTENDERS, contender_env, missing_requirement
from .launch import RankError, run_ranks
from .runner import RunSpec, run_contender


def run_spec(
    spec: RunSpec,
    *,
    log_dir: str,
    timeout_s: float,
    fresh_cache: bool = True,
    cache_dir: str | None = None,
    log_name: str | None = None,
) -> dict:
    """Run one contender in fresh processes; its summary row, or a row saying why not.

    fresh_cache: a new Inductor/Triton cache directory, so compile times are cold-cache times.
        The ranks of one run share it, as ranks on one node share Inductor's default cache:
        a kernel one rank is building, the others wait for and load.
    cache_dir: use (and keep) this cache directory instead: a second run with the same one
        measures a warm restart.
    """
    contender = CONTENDERS[spec.contender]
    missing = missing_requirement(contender)
    if missing:
        return {"status": f"skipped: {missing}"}
    env = {
        "OMP_NUM_THREADS": str(spec.threads),
        "PYTHONUNBUFFERED": "1",
        **contender_env(contender, spec.device),
    }
    cache = tempfile.mkdtemp(prefix=f"bench-inductor-{spec.contender}-") if fresh_cache else None
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    elif cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    # one process per rank; one process for ``single`` and for the fake group's rank 0
    processes = spec.world if contender.distributed and spec.backend != "fake" else 1
    try:
        ranks = run_ranks(
            run_contender,
            processes,
            (spec,),
            log_dir=log_dir,
            name=log_name or spec.contender,
            timeout_s=timeout_s,
            env=env,
        )
    except RankError as error:
        message = str(error).strip()
        print(f"  {spec.contender} FAILED:\n    " + "\n    ".join(message.splitlines()[-15:]))
        return {"status": f"failed: {message.splitlines()[-1]}", "error": message}
    finally:
        if cache and cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)
    return report.summarize(ranks, spec.warmup, contender.comm_source)
