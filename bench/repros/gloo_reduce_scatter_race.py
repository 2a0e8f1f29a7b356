"""Standalone reproduction: gloo corrupts the heap with collectives in flight together (torch
2.13 and 2.14, torch alone).

    python bench/repros/gloo_reduce_scatter_race.py --jobs 6 --seconds 8                  # aborts
    python bench/repros/gloo_reduce_scatter_race.py --jobs 6 --seconds 8 --as-all-reduce  # aborts
    python bench/repros/gloo_reduce_scatter_race.py --jobs 6 --seconds 8 --variant serial # none
    python bench/repros/gloo_reduce_scatter_race.py --jobs 6 --seconds 8 --variant chain  # none

The soak's aborts (``malloc(): unaligned tcache chunk detected``, a SIGSEGV in ``malloc``) all
had a gloo worker thread in an all-reduce while the main thread was inside gloo's reduce-scatter.
This job does what a zero3 backward does to one process group, with torch alone: all-gathers in
flight (prefetch), functional reduce-scatters of freshly built buckets of varying sizes whose
inputs are dropped before the waits, small allocations on the main thread meanwhile. It aborts
with the soak's stack within seconds. Every result is checked against the exact sum, so a silent
corruption counts too. ``--as-all-reduce`` issues the reduce-scatters as all-reduces (zero3's
workaround: not immune); ``--variant`` (comma-separated) isolates the ingredients: ``serial``
waits each collective at once (one in flight: no abort seen), ``chain`` waits each one right
before the next is issued while the main thread goes on allocating (one in flight, overlapped
with work: zero3's ``serial_collectives``; no abort seen), ``no-gathers``, ``no-reductions``,
``one-gather``, ``keep-inputs``, ``no-junk``, ``two-groups`` (the reductions on a group of
their own). ``REPRO_LOGS=dir`` keeps the failed ranks' output. Figures: bench/RESULTS.md, Soak.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from two_ranks import run_job  # the sibling file: run this one as a script


def rank_main(seconds: float, as_all_reduce: bool, variant: set[str]) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    gather_group = group
    if "two-groups" in variant:  # the reductions on a process group of their own
        group = dist.new_group(list(range(world))).group_name
    c10d = torch.ops._c10d_functional
    gen = torch.Generator().manual_seed(1234)  # the same sizes on every rank
    # every rank must run the same number of iterations (a rank that issues one collective
    # more than its peer pairs mismatched buffers: that corrupts memory by itself), so the
    # ranks agree on when to stop
    deadline = time.monotonic() + seconds
    iterations = wrong = 0
    stop = torch.zeros(1)
    while not stop.item():
        if iterations % 100 == 0:
            stop.fill_(float(time.monotonic() > deadline))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        sizes = torch.randint(1, 4096, (6,), generator=gen).tolist()
        kept = []
        gathers = []
        for n in (
            sizes[: 1 if "one-gather" in variant else 3] if "no-gathers" not in variant else []
        ):
            shard = torch.full((n,), float(rank))
            if "chain" in variant and gathers:  # one in flight, the main thread goes on
                gathers[-1] = (gathers[-1][0], c10d.wait_tensor(gathers[-1][1]))
            gathers.append((n, c10d.all_gather_into_tensor(shard, world, gather_group)))
            if "serial" in variant:  # one collective in flight at a time
                gathers[-1] = (n, c10d.wait_tensor(gathers[-1][1]))
            if "keep-inputs" in variant:
                kept.append(shard)
            del shard
        results = []
        for n in sizes[3:] if "no-reductions" not in variant else []:
            bucket = torch.arange(world * n, dtype=torch.float32) + rank  # built, then dropped
            if "chain" in variant:
                if results:
                    results[-1] = (results[-1][0], c10d.wait_tensor(results[-1][1]))
                elif gathers:
                    gathers[-1] = (gathers[-1][0], c10d.wait_tensor(gathers[-1][1]))
            if as_all_reduce:
                results.append((n, c10d.all_reduce(bucket, "sum", group)))
            else:
                results.append((n, c10d.reduce_scatter_tensor(bucket, "sum", world, group)))
            if "serial" in variant:
                results[-1] = (n, c10d.wait_tensor(results[-1][1]))
            if "keep-inputs" in variant:
                kept.append(bucket)
            del bucket
            if "no-junk" not in variant:
                junk = [torch.empty(k % 97 + 1) for k in range(64)]  # small allocations
                del junk
        for n, out in results:
            out = c10d.wait_tensor(out)
            if as_all_reduce:
                out = out.narrow(0, rank * n, n)
            want = (torch.arange(n, dtype=torch.float32) + rank * n) * world + sum(range(world))
            wrong += not torch.equal(out, want)
        for n, g in gathers:
            g = c10d.wait_tensor(g)
            want = torch.arange(world, dtype=torch.float32).repeat_interleave(n)
            wrong += not torch.equal(g, want)
        del kept
        iterations += 1
    dist.barrier()
    print(f"rank {rank}: {iterations} iterations, {wrong} wrong results", flush=True)
    dist.destroy_process_group()
    sys.exit(3 if wrong else 0)


def one_job(seconds: float, as_all_reduce: bool, variant: str) -> tuple[list[str], str]:
    args = ["--seconds", str(seconds)] + (["--as-all-reduce"] if as_all_reduce else [])
    args += ["--variant", variant] if variant else []
    outcomes, texts = [], []
    for rank, (rc, text) in enumerate(run_job(__file__, args, seconds + 120)):
        if rc != 0 and os.environ.get("REPRO_LOGS"):
            name = f"{os.getpid()}-{time.monotonic_ns()}-rank{rank}.log"
            with open(os.path.join(os.environ["REPRO_LOGS"], name), "w") as f:
                f.write(text)
        texts.append(text.strip().splitlines()[-1] if text.strip() else "")
        if rc is None:
            outcomes.append("hang")
        elif rc < 0:
            outcomes.append(f"signal {-rc}")
        elif rc == 3:
            outcomes.append("wrong")
        elif rc != 0:
            outcomes.append(f"error {rc}")
        else:
            outcomes.append("ok")
    return outcomes, " | ".join(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0, help="per job")
    parser.add_argument("--as-all-reduce", action="store_true")
    parser.add_argument(
        "--variant",
        default="",
        help="comma-separated: keep-inputs, no-gathers, no-reductions, no-junk, one-gather, "
        "two-groups, serial, chain",
    )
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args.seconds, args.as_all_reduce, set(args.variant.split(",")) - {""})
    failed = 0
    for i in range(args.jobs):
        outcomes, text = one_job(args.seconds, args.as_all_reduce, args.variant)
        failed += any(o != "ok" for o in outcomes)
        print(f"[{i + 1}/{args.jobs}] {' '.join(outcomes)}  {text}", flush=True)
    import torch

    mode = "all-reduce" if args.as_all_reduce else "reduce-scatter"
    print(
        f"torch {torch.__version__} {mode} {args.variant or 'base'}: "
        f"{failed} of {args.jobs} jobs failed"
    )


if __name__ == "__main__":
    main()
