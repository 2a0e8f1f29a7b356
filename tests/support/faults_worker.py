"""Run ``examples/train.py`` on one rank, optionally killing this rank at a chosen point.

    python tests/support/faults_worker.py [--fault KIND --at N --death-file F] -- <train.py arguments>

The rank SIGKILLs itself (``--signal STOP``: stops, a hung rank) after writing the time to
``--death-file``, at the ``N``-th (from 0) occurrence of:

- ``forward`` / ``backward``: right after zero3's cross-rank check of a compiled forward /
  backward graph passed, so the peers are inside that graph's collectives;
- ``optimizer``: at the start of ``optimizer.step()`` (after gradient clipping's all-reduce);
- ``checkpoint``: while DCP writes this rank's shards in ``save_checkpoint``;
- ``compile``: when the zero3 backend starts compiling a graph.

Launched with the environment of ``torch.distributed``'s ``env://`` (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), one process per rank, without torchrun: what the other ranks do on
their own is what the tests look at.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SIGNAL = [signal.SIGKILL]


def die(death_file: str) -> None:
    with open(death_file, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), SIGNAL[0])


def install(fault: str, at: int, death_file: str) -> None:
    count = [0]

    def occurrence() -> None:
        count[0] += 1
        if count[0] > at:
            die(death_file)

    if fault in ("forward", "backward"):
        import zero3_compile.runtime.gate as runtime
        import zero3_compile.runtime.guard as guard

        kind = guard.KIND_FORWARD if fault == "forward" else guard.KIND_BACKWARD
        original = runtime.run_graph_guard

        def run_graph_guard(group_name, replicate_group, graph_kind, *args):
            original(group_name, replicate_group, graph_kind, *args)
            if graph_kind == kind:
                occurrence()

        runtime.run_graph_guard = run_graph_guard  # zero3::guard looks it up at each call
    elif fault == "optimizer":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: occurrence())
    elif fault == "checkpoint":
        from torch.distributed.checkpoint import FileSystemWriter

        original_write = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            occurrence()
            return original_write(self, plan, planner)

        FileSystemWriter.write_data = write_data
    elif fault == "compile":
        import zero3_compile.compiler.backend as backend

        original_pipeline = backend.run_pipeline

        def run_pipeline(*args, **kwargs):
            occurrence()
            return original_pipeline(*args, **kwargs)

        backend.run_pipeline = run_pipeline
    else:
        raise ValueError(f"unknown fault {fault!r}")


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default=None)
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--death-file", default=None)
    parser.add_argument("--signal", default="KILL", help="KILL, or STOP: a hung rank")
    args = parser.parse_args(argv[:split])
    SIGNAL[0] = getattr(signal, f"SIG{args.signal}")
    spec = importlib.util.spec_from_file_location(
        "train", os.path.join(ROOT, "examples", "train.py")
    )
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    if args.fault:
        install(args.fault, args.at, args.death_file)
    train.main(argv[split + 1 :])


if __name__ == "__main__":
    main()
