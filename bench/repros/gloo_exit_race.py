"""Standalone reproduction: a gloo worker thread aborts the process at interpreter exit.

    python bench/repros/gloo_exit_race.py --runs 50            # torch alone: aborts
    python bench/repros/gloo_exit_race.py --runs 50 --zero3    # with zero3's exit handler: none

Each run is a 2-rank gloo job that ends the way training scripts do (``all_gather_object``, rank 0
writes a file, ``barrier``, ``destroy_process_group``, return) while a DTensor parameter at module
level keeps the default process group, and so its worker threads, alive into interpreter
finalization. A worker that then drops the last reference to a tensor takes the GIL to free its
Python object; during finalization that ends the thread from inside a ``noexcept`` frame and the
process dies with "terminate called without an active exception" (SIGABRT). Unamplified it hits
about one job in 20 to 300 (the soak saw it once in 300); to make it frequent, each rank runs on
its own core, torch's threads at idle priority, and the main thread holds the GIL for 1 ms after
the barrier. ``--zero3`` shards a small model instead, which registers zero3's exit handler.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

from two_ranks import run_job  # the sibling file: run this one as a script


def rank_main(use_zero3: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    before = set(os.listdir("/proc/self/task"))
    dist.init_process_group("gloo")
    for tid in set(os.listdir("/proc/self/task")) - before:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    world = dist.get_world_size()
    model = torch.nn.Linear(8, 8)
    if use_zero3:
        import zero3_compile as z3

        z3.shard(model)
        model(torch.ones(2, 8)).sum().backward()
    else:
        mesh = init_device_mesh("cpu", (world,))
        model.weight = torch.nn.Parameter(
            distribute_tensor(model.weight.detach(), mesh, [Shard(0)])
        )
    globals()["_kept"] = model  # outlives main(), as a model at module level does

    out = [None] * world
    dist.all_gather_object(out, {"rank": rank})
    if rank == 0:
        with open(os.devnull, "w") as f:
            f.write(repr(out))
    dist.barrier()
    ctypes.PyDLL(None).usleep(1000)  # a 1 ms pause holding the GIL
    dist.destroy_process_group()


def one_job(use_zero3: bool, timeout_s: float) -> list[str]:
    """Each rank's outcome: "ok", "abort" (terminate called / killed by a signal), "hang"."""
    outcomes = []
    for rc, text in run_job(__file__, ["--zero3"] if use_zero3 else [], timeout_s):
        if rc is None:
            outcomes.append("hang")
        elif rc < 0 or "terminate called" in text:
            outcomes.append("abort")
        elif rc != 0:
            sys.stderr.write(text)
            outcomes.append(f"error {rc}")
        else:
            outcomes.append("ok")
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--zero3", action="store_true", help="shard with zero3 (its exit handler)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args.zero3)
    failed = 0
    for i in range(args.runs):
        outcomes = one_job(args.zero3, args.timeout)
        failed += any(o != "ok" for o in outcomes)
        print(f"[{i + 1}/{args.runs}] {' '.join(outcomes)}", flush=True)
    import torch

    print(f"torch {torch.__version__} zero3={args.zero3}: {failed} of {args.runs} jobs failed")


if __name__ == "__main__":
    main()
