"""Run a function on N gloo ranks in fresh processes; collect results; never hang."""

from __future__ import annotations

import faulthandler
import functools
import io
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# What every rank imports, loaded once into a fork server the ranks are forked from: spawning
# each rank afresh paid ~3 s of imports per rank, per test (a third of the suite's time on 2 cores),
# and a rank's first compile another 0.7 s (AOTAutograd, the partitioner and networkx, Inductor's
# lowerings, which the eager codegen imports too). Modules only: each rank still starts with
# empty compile caches.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._dynamo.backends.common",
    "torch._dynamo.repro.after_dynamo",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.config",
    "torch._inductor.compile_fx",
    "torch._inductor.lowering",
    "torch._inductor.pattern_matcher",
    "torch._inductor.fx_passes.joint_graph",
    "torch._inductor.codegen.cpp",
    "torch.export._trace",
    "torch.utils.cpp_extension",
    "networkx",
    "sympy",
    "zero3_compile",
    # the Hugging Face tests' ranks (test_hf, test_model_zoo, test_per_block): 1-2 s each
    "transformers",
    "transformers.models.llama.modeling_llama",
    # facts Inductor computes once per process (the CPU's vector instruction sets: ~1 s)
    "tests.support.rank_preload",
]
# read by torch at import time, so set in the fork server's environment (and again in each rank)
RANK_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
# a test's own environment variables that torch reads only when it uses them (not at import):
# their ranks can still be forked from the fork server
READ_AT_USE = {"TORCHINDUCTOR_CACHE_DIR"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world_size: int, port: int, results, args, env) -> None:
    # a forked rank starts with the fork server's environment: take the test process's as a
    # spawned one would
    os.environ.clear()
    os.environ.update(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    config = sys.modules.get("torch._inductor.config")
    if config is not None:  # imported by the fork server, from the server's environment
        config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    status, payload = "ok", None
    # a rank killed by a signal (an abort on heap corruption, a segfault) prints every thread's
    # Python stack to stderr, which pytest shows with the failure
    faulthandler.enable(all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        payload = fn(rank, world_size, *args)
    except BaseException:  # report everything, including assertion errors and KeyboardInterrupt
        status, payload = "error", traceback.format_exc()
    if status == "ok":
        # tensors travel as bytes: torch's shared-memory handles die with this process
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        payload = buffer.getvalue()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    # Skip interpreter teardown: the result is delivered, and process-group / compile-worker
    # destructors at exit are not what the tests are about.
    os._exit(0)


@functools.cache
def _forkserver() -> multiprocessing.context.BaseContext:
    """The fork-server context, its server started once with ``PRELOAD`` imported."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(RANK_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


def _load(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=True)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; returns the results ordered by rank.

    Raises with the failing rank's traceback if any rank fails, and kills every rank if they do
    not all finish within ``timeout`` seconds (a hang is a test failure, never a stuck suite).
    """
    # an environment of the test's own may change what torch reads at import: spawn those ranks
    forked = not env or set(env) <= READ_AT_USE
    ctx = _forkserver() if forked else multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {**os.environ, **RANK_ENV, **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args, env))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(outputs) - set(errors))} did not "
                    f"finish within {timeout:.0f}s (errors so far: {errors})"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in outputs and i not in errors
                ]
                if dead:
                    # a rank died without reporting (segfault, abort): give the others a moment
                    # to report their own error, then fail
                    time.sleep(2.0)
                    while not results.empty():
                        rank, status, payload = results.get()
                        if status == "ok":
                            outputs[rank] = _load(payload)
                        else:
                            errors[rank] = payload
                    raise RuntimeError(
                        f"rank(s) {dead} died with exit codes {[procs[i].exitcode for i in dead]}; "
                        f"errors: {errors}"
                    ) from None
                continue
            if status == "ok":
                outputs[rank] = _load(payload)
            else:
                errors[rank] = payload
                # one failure usually leaves the others blocked in a collective: stop waiting
                # for them after a grace period so the first error is reported quickly
                deadline = min(deadline, time.monotonic() + 20.0)
        if errors:
            first = _cause(errors)
            raise RuntimeError(f"rank {first} failed:\n{errors[first]}")
        return [outputs[r] for r in range(world_size)]
    except TimeoutError:
        if errors:
            first = _cause(errors)
            raise RuntimeError(f"rank {first} failed:\n{errors[first]}") from None
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)


__all__ = ["free_port", "run_ranks"]


def _each(rank: int, world_size: int, fn, arg_list: list[tuple]) -> list[Any]:
    return [fn(rank, world_size, *args) for args in arg_list]


# what a rank reports when another rank failed first and left it (the other's error is the cause)
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "lost its connection")


def _cause(errors: dict[int, str]) -> int:
    """The rank whose error to report: the lowest one that failed on its own, not because a
    peer went away (else the lowest)."""
    own = [rank for rank, text in errors.items() if not any(s in text for s in _SECONDARY)]
    return min(own or errors)


def run_scenarios(
    fn: Callable[..., Any], world_size: int, arg_list: list[tuple], timeout: float = 900.0
) -> dict[tuple, list[Any]]:
    """Run ``fn(rank, world_size, *args)`` for every ``args`` in one process group (processes
    are expensive to start); returns {args: per-rank results}."""
    per_rank = run_ranks(_each, world_size, fn, arg_list, timeout=timeout)
    return {tuple(args): [ranks[i] for ranks in per_rank] for i, args in enumerate(arg_list)}
