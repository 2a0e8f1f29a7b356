"""The launcher both reproductions share: one 2-rank gloo job on loopback, in fresh processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(script: str, args: list[str], timeout_s: float) -> list[tuple[int | None, str]]:
    """``python script --rank-main *args`` on ranks 0 and 1; each rank's (exit code, or None
    when it ran past ``timeout_s`` and was killed; its stdout and stderr)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")  # fmt: skip
        log = tempfile.TemporaryFile()
        argv = [sys.executable, script, "--rank-main", *args]
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    deadline = time.monotonic() + timeout_s
    for proc, log in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        log.seek(0)
        results.append((rc, log.read().decode(errors="replace")))
    return results
