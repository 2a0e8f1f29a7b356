"""One command for a lent NVIDIA GPU (an H200): what the passes cost, and memory at world 8.

    python -m bench.gpu               # needs CUDA; writes gpu.md, gpu.json, gpu_logs.txt to $OUT
    python -m bench.gpu --cpu-smoke   # the same plan with tiny models on CPU (checks the script)

Part A, world 1 over NCCL, GPT-2 small (124M) at batch 8 x 1024: zero3 against plain
torch.compile of the unsharded model and FSDP2 (eager and per-block compiled). At world 1 no
collective moves data, so the differences are the overhead of each system's machinery.

Part B, the ``fake`` process group as rank 0 of 8, a ~1.1B-parameter Llama-style model on CUDA:
per-rank persistent state and peak allocated memory, zero3 against FSDP2, and the ideal
(parameters + gradients + AdamW state) / 8.

The runs stay inside a time budget (--budget, default 420 s): a run gets at most the time
left, and runs that no longer fit are reported as skipped.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

import torch

from bench.harness import report
from bench.harness.orchestrate import run_spec
from bench.harness.paths import results_dir
from bench.harness.runner import RunSpec

MiB = report.MiB
PART_A = ["zero3", "single-compiled", "fsdp2", "fsdp2-compiled"]
PART_B = ["zero3", "fsdp2"]
PART_A_REFERENCE = "single-compiled"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on CPU, no GPU")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all runs")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="default: $OUT")
    return parser.parse_args(argv)


def cuda_problem() -> str | None:
    """Why this machine cannot run the GPU plan, or None."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        return (
            f"gpu.py needs an NVIDIA GPU, but CUDA is not available (torch {torch.__version__}, "
            f"built with {built}). Run it on the GPU machine, or use --cpu-smoke to check the "
            "script on CPU."
        )
    return None


def plan(smoke: bool) -> list[tuple[str, RunSpec]]:
    """(part, spec) of every run, in order."""
    device = "cpu" if smoke else "cuda"
    part_a = dict(
        preset="quick" if smoke else "gpt-medium-gpu",
        world=1,
        device=device,
        backend="gloo" if smoke else "nccl",
        warmup=2,
        steps=5 if smoke else 20,
    )
    part_b = dict(
        preset="llama-tiny" if smoke else "llama-1b",
        world=8,
        device=device,
        backend="fake",
        warmup=1,
        steps=2,
    )
    threads = 1 if smoke else max(1, min(8, os.cpu_count() or 1))
    runs = [("A", RunSpec(c, seed=0, threads=threads, **part_a)) for c in PART_A]
    runs += [("B", RunSpec(c, seed=0, threads=threads, **part_b)) for c in PART_B]
    # the optional comparison last: what the budget cuts should be the least needed
    return sorted(runs, key=lambda run: run[1].contender == "fsdp2-compiled")


def execute(args: argparse.Namespace, log_dir: str) -> dict[str, dict[str, dict]]:
    deadline = time.monotonic() + args.budget
    results: dict[str, dict[str, dict]] = {"A": {}, "B": {}}
    for part, spec in plan(args.cpu_smoke):
        left = deadline - time.monotonic()
        if left < 30:
            results[part][spec.contender] = {"status": "skipped: the time budget is spent"}
            continue
        print(f"part {part}: {spec.contender} ({spec.preset}, world {spec.world}) ...", flush=True)
        began = time.monotonic()
        results[part][spec.contender] = run_spec(
            spec,
            log_dir=log_dir,
            timeout_s=left,
            log_name=f"{part}-{spec.contender}",
        )
        status = results[part][spec.contender]["status"]
        print(f"  {status} ({time.monotonic() - began:.0f} s)", flush=True)
    return results


def part_a_text(rows: dict[str, dict], device: str) -> str:
    has_reference = rows.get(PART_A_REFERENCE, {}).get("status") == "ok"
    deviations = report.check_losses(rows, PART_A_REFERENCE) if has_reference else {}
    return "\n\n".join(
        part
        for part in (
            "## A. World 1: overhead of the machinery",
            report.loss_banner(rows, deviations, PART_A_REFERENCE),
            report.speed_table(rows, "fsdp2"),
            report.memory_table(rows),
            report.loss_table(rows, deviations, PART_A_REFERENCE) if deviations else "",
            "\n".join(report.not_measured(rows)),
            f"Peak: {'torch.cuda.max_memory_allocated' if device == 'cuda' else 'CPU estimate'} "
            "over the profiled step.",
        )
        if part
    )


def part_b_text(rows: dict[str, dict]) -> str:
    lines = [
        "## B. Fake process group, rank 0 of 8: memory per rank",
        "",
        "| contender | persistent MiB | ideal MiB | params / grads / optimizer MiB "
        "| peak allocated MiB | at step start MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']} | | | | |")
            continue
        state = row["state_bytes"]["rank0"]
        ideal = 4 * row["param_bytes"] / 8  # params + grads + AdamW's two moments, 1/8 each
        split = " / ".join(f"{state[k] / MiB:.1f}" for k in ("params", "grads", "optimizer"))
        peak = row["alloc_peak_bytes"]
        lines.append(
            f"| {name} | {sum(state.values()) / MiB:.1f} | {ideal / MiB:.1f} | {split} "
            f"| {peak['rank0'] / MiB:.1f} | {peak['rank0_at_step_start'] / MiB:.1f} |"
        )
    return "\n".join(lines)


def collect_logs(log_dir: str, path: str) -> None:
    """Every rank's log in one file (the device machine returns few files)."""
    with open(path, "w") as out:
        for log in sorted(glob.glob(os.path.join(log_dir, "*.log"))):
            out.write(f"===== {os.path.basename(log)}\n")
            with open(log, errors="replace") as f:
                out.write(f.read())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = None if args.cpu_smoke else cuda_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if not args.out:
        args.out = results_dir("gpu")
        print(f"gpu.py: $OUT is not set; writing to {args.out}")
    os.makedirs(args.out, exist_ok=True)
    # logs stay outside $OUT: the device machine sends back only a few files
    log_dir = tempfile.mkdtemp(prefix="bench-gpu-logs-")
    start = time.monotonic()
    results = execute(args, log_dir)
    device = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(0)
    text = (
        f"# gpu.py on {device}\n\ntorch {torch.__version__}, "
        f"{time.monotonic() - start:.0f} s{' (CPU smoke run)' if args.cpu_smoke else ''}.\n\n"
        f"{part_a_text(results['A'], 'cpu' if args.cpu_smoke else 'cuda')}\n\n"
        f"{part_b_text(results['B'])}\n"
    )
    print()
    print(text)
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(text)
    report.write_json(
        os.path.join(args.out, "gpu.json"),
        {
            "device": device,
            "torch": torch.__version__,
            "plan": [{"part": part, **vars(spec)} for part, spec in plan(args.cpu_smoke)],
            **results,
        },
    )
    collect_logs(log_dir, os.path.join(args.out, "gpu_logs.txt"))
    print(f"wrote gpu.md, gpu.json, gpu_logs.txt under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
