"""Run a function on N ranks in fresh processes, each rank's output in its own log file.

Fresh processes per contender keep one system's allocator state, compiled code and monkeypatches
out of the next one's measurements. The function initialises its own process group (gloo, nccl,
fake or DeepSpeed's), so the launcher only sets the usual torchrun environment variables.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message holds the tail of its log."""


def set_rank_threads(world: int) -> None:
    """Give this rank its share of the machine's cores: ``torch.set_num_threads(cores // world)``
    (at least 1)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker(fn, rank, world_size, results, args, log_path) -> None:
    # Redirect at the file-descriptor level so C++ warnings (gloo, inductor) land in the log too.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        message = (rank, "ok", fn(rank, world_size, *args))
    except BaseException:  # report everything, a KeyboardInterrupt included
        message = (rank, "error", traceback.format_exc())
    results.put(message)
    results.close()
    results.join_thread()
    # Skip interpreter teardown: process-group and compile-worker destructors can hang or crash
    # after the result is already delivered.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    log_dir: str,
    name: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank in a spawned process; results by rank.

    ``fn`` must return picklable plain data. Raises ``RankError`` if a rank fails, dies or the
    ranks do not all finish within ``timeout_s``; every process is killed on the way out.
    """
    os.makedirs(log_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    logs = [os.path.join(log_dir, f"{name}.rank{r}.log") for r in range(world_size)]
    procs = []
    for rank in range(world_size):
        process = ctx.Process(
            target=_worker, args=(fn, rank, world_size, results, args, logs[rank])
        )
        rank_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(world_size),  # DeepSpeed's CPU accelerator reads this one
            **(env or {}),
        }
        with _environment(rank_env):  # inherited from interpreter start, before any import
            process.start()
        procs.append(process)
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise RankError(
                    f"{name}: rank(s) {missing} did not finish within {timeout_s:.0f}s; "
                    f"log of rank {missing[0]}:\n{log_tail(logs[missing[0]])}"
                )
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(
                        f"{name}: rank {dead[0]} died (exit code {procs[dead[0]].exitcode}); "
                        f"its log:\n{log_tail(logs[dead[0]])}"
                    ) from None
                continue
            if status != "ok":
                raise RankError(f"{name}: rank {rank} failed:\n{payload}")
            outputs[rank] = payload
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
