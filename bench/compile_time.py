"""Compile time, cold and warm: zero3 next to DDP compiled and FSDP2 compiled, same model.

    python -m bench.compile_time --world 2                      # quick and gpt-small
    python -m bench.compile_time --world 2 --models quick
    python -m bench.compile_time --depth 2,8,24,80              # cold compile against depth

For each contender and model: a cold start (an empty Inductor / AOTAutograd cache directory),
then a restart with the same cache directory (what a preempted job pays when it comes back).
Compile seconds = the first step minus the median of the following ones, slowest rank. For
zero3, the cold compile's breakdown by phase (ours, the partitioner, Inductor on the scheduled
graphs) on rank 0. C++ kernels: the distinct kernels Inductor generated for the cold start (on
CPU each one is a compiler run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

from bench.harness.orchestrate import run_spec
from bench.harness.paths import results_dir
from bench.harness.runner import RunSpec

CONTENDERS = ("zero3", "ddp-compiled", "fsdp2-compiled")
# --depth: the whole model and each block compiled, against plain compile and FSDP2's per block
DEPTH_CONTENDERS = (
    "zero3",
    "zero3-regions",
    "zero3-per-block",
    "zero3-eager-codegen",
    "single-compiled",
    "fsdp2-compiled",
)


def measure(
    contender: str,
    model: str,
    world: int,
    out: str,
    threads: int,
    n_layer: int | None = None,
    warm_restart: bool = True,
) -> dict:
    cache = tempfile.mkdtemp(prefix=f"bench-compile-{contender}-")
    try:
        spec = RunSpec(
            contender=contender,
            preset=model,
            world=world,
            device="cpu",
            backend="gloo",
            warmup=1,
            steps=3,
            seed=0,
            threads=threads,
            record_graphs=False,  # recorded graphs are always compiled, never loaded
            n_layer=n_layer,
        )
        logs = os.path.join(out, "logs")
        name = f"{contender}-{model}" + (f"-L{n_layer}" if n_layer else "")
        cold = run_spec(
            spec, log_dir=logs, timeout_s=3600, cache_dir=cache, log_name=f"{name}-cold"
        )
        warm = (
            run_spec(spec, log_dir=logs, timeout_s=3600, cache_dir=cache, log_name=f"{name}-warm")
            if warm_restart
            else {}
        )
        kernels = _generated_kernels(cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    row = {
        "kernels": kernels,
        "cold_s": cold["compile_s"]["max"] if cold.get("status") == "ok" else None,
        "warm_s": warm["compile_s"]["max"] if warm.get("status") == "ok" else None,
        "step_s": cold["step_s"]["max_median"] if cold.get("status") == "ok" else None,
        "status": (cold.get("status"), warm.get("status")),
    }
    if contender.startswith("zero3") and cold.get("status") == "ok":
        row["breakdown"] = cold["ranks"][0].get("zero3_compile_s", {})
        if warm.get("status") == "ok":
            row["warm_breakdown"] = warm["ranks"][0].get("zero3_compile_s", {})
    return row


def _generated_kernels(cache: str) -> int:
    """Distinct C++ kernels Inductor generated (and compiled, one compiler run each on CPU) for
    the job: the ``.cpp`` sources in its cache directory, shared by the ranks."""
    return sum(name.endswith(".cpp") for _, _, names in os.walk(cache) for name in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--models", default="quick,gpt-small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--depth",
        default="",
        help="comma-separated block counts: cold compiles of --depth-model at each depth",
    )
    parser.add_argument("--depth-model", default="gpt-w128")
    parser.add_argument("--depth-contenders", default=",".join(DEPTH_CONTENDERS))
    parser.add_argument("--out", default=results_dir())
    args = parser.parse_args(argv)
    if args.depth:
        return depth_table(args)
    results = {}
    for model in args.models.split(","):
        for contender in CONTENDERS:
            print(f"{contender} on {model} ...", file=sys.stderr, flush=True)
            results[(model, contender)] = measure(
                contender, model, args.world, args.out, args.threads
            )
    print(
        f"\n{args.world} CPU ranks, gloo, torch {torch.__version__}, compile seconds (slowest rank)\n"
    )
    print(
        "| model | contender | cold s | warm restart s | cold vs DDP compiled | warm vs DDP compiled "
        "| C++ kernels |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        ddp = results[(model, "ddp-compiled")]
        for contender in CONTENDERS:
            row = results[(model, contender)]
            cold, warm = row["cold_s"], row["warm_s"]

            def ratio(value, base):
                return f"{value / base:.2f}x" if value is not None and base else "-"

            print(
                f"| {model} | {contender} | {cold if cold is None else f'{cold:.1f}'} | "
                f"{warm if warm is None else f'{warm:.1f}'} | {ratio(cold, ddp['cold_s'])} | "
                f"{ratio(warm, ddp['warm_s'])} | {row['kernels']} |"
            )
    for model in args.models.split(","):
        row = results[(model, "zero3")]
        if "breakdown" in row:
            print(f"\nzero3 cold compile on {model}, rank 0, seconds by phase:\n")
            for phase, seconds in sorted(row["breakdown"].items(), key=lambda kv: -kv[1]):
                print(f"- {phase}: {seconds:.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"compile-time-w{args.world}.json"), "w") as f:
        json.dump({f"{m}/{c}": r for (m, c), r in results.items()}, f, indent=1, default=str)
    return 0


def depth_table(args) -> int:
    """Cold compile seconds (first step minus a steady step, slowest rank) and steady step
    time at each depth, every contender side by side."""
    depths = [int(d) for d in args.depth.split(",")]
    contenders = args.depth_contenders.split(",")
    rows = {}
    for depth in depths:
        for contender in contenders:
            print(f"{contender} at {depth} blocks ...", file=sys.stderr, flush=True)
            rows[(depth, contender)] = measure(
                contender,
                args.depth_model,
                args.world,
                args.out,
                args.threads,
                n_layer=depth,
                warm_restart=False,
            )
    print(
        f"\n{args.world} CPU ranks, gloo, torch {torch.__version__}, {args.depth_model} blocks, "
        "cold compile s (slowest rank) / steady step ms\n"
    )
    print("| blocks | " + " | ".join(contenders) + " |")
    print("|---:|" + "---:|" * len(contenders))
    for depth in depths:
        cells = []
        for contender in contenders:
            row = rows[(depth, contender)]
            cold, step = row["cold_s"], row["step_s"]
            cells.append("-" if cold is None else f"{cold:.1f} s / {1e3 * step:.0f} ms")
        print(f"| {depth} | " + " | ".join(cells) + " |")
    first = depths[0]
    print(f"\ncold compile relative to {first} blocks:\n")
    for contender in contenders:
        base = rows[(first, contender)]["cold_s"]
        ratios = [
            f"{rows[(d, contender)]['cold_s'] / base:.2f}x"
            if base and rows[(d, contender)]["cold_s"]
            else "-"
            for d in depths
        ]
        print(f"- {contender}: " + ", ".join(ratios))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"compile-depth-w{args.world}.json"), "w") as f:
        json.dump({f"{d}/{c}": r for (d, c), r in rows.items()}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
