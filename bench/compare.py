"""Compare zero3_compile with FSDP2, DeepSpeed ZeRO-3 and DDP: same model, data, seed, machine.

    python -m bench.compare --world 2 --quick            # small GPT, few steps, all contenders
    python -m bench.compare --world 2 --model gpt-small  # ~25M parameters (gpt-medium: ~124M)
    python -m bench.compare --world 8 --model llama-1b   # GPU only (nccl)

Each contender runs in fresh processes (one per rank) with a fresh Inductor cache, so compile
times are cold-cache times. Prints markdown tables (speed, memory, communication, loss agreement)
and writes them with a JSON file, a PNG chart and every rank's log under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from bench.harness import report
from bench.harness.contenders import CONTENDERS, DEFAULT_SET, REFERENCE, SPEED_BASELINE
from bench.harness.models import PRESETS
from bench.harness.orchestrate import run_spec
from bench.harness.paths import results_dir
from bench.harness.runner import RunSpec

DEFAULT_OUT = results_dir()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--quick", action="store_true", help="small model, 2+20 steps")
    parser.add_argument("--model", choices=sorted(PRESETS), default="gpt-small")
    parser.add_argument("--warmup", type=int, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=int, help="timed steps after warm-up")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_SET),
        help=f"comma-separated subset of: {', '.join(CONTENDERS)}",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores/world)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--zero3-options",
        default="{}",
        help="JSON options for the zero3 contenders, e.g. '{\"bucket_mb\": 5}'",
    )
    parser.add_argument("--timeout", type=float, help="seconds per contender")
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="reuse Inductor's default cache (faster reruns; compile times are then warm)",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory for JSON, chart and logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.model = "quick"
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else 20
    args.timeout = args.timeout or (600.0 if args.quick else 3600.0)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the first warm-up step compiles)")
    try:
        if not isinstance(json.loads(args.zero3_options), dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        parser.error(f"--zero3-options must be a JSON object like '{{\"bucket_mb\": 5}}': {error}")
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contender(s) {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    return args


def resolve_device(choice: str, world: int, preset_name: str) -> str:
    """The device to run on; exits with a message when the choice cannot work here."""
    cuda = torch.cuda.is_available()
    device = ("cuda" if cuda else "cpu") if choice == "auto" else choice
    if device == "cuda" and not cuda:
        sys.exit("compare.py: --device cuda, but CUDA is not available on this machine")
    if device == "cuda" and torch.cuda.device_count() < world:
        sys.exit(
            f"compare.py: --world {world} needs {world} GPUs, found {torch.cuda.device_count()}"
        )
    if PRESETS[preset_name].gpu_only and device != "cuda":
        sys.exit(f"compare.py: the {preset_name} preset is GPU only (no CUDA here)")
    return device


def run_one(name: str, args: argparse.Namespace, device: str, log_dir: str) -> dict:
    """Run one contender in fresh processes; its summary row, or a row saying why not."""
    spec = RunSpec(
        contender=name,
        preset=args.model,
        world=args.world,
        device=device,
        backend="nccl" if device == "cuda" else "gloo",
        warmup=args.warmup,
        steps=args.steps,
        seed=args.seed,
        threads=args.threads or max(1, (os.cpu_count() or 1) // args.world),
        zero3_options=args.zero3_options,
    )
    return run_spec(
        spec,
        log_dir=log_dir,
        timeout_s=args.timeout,
        fresh_cache=not args.warm_cache,
    )


def describe_run(
    rows: dict[str, dict], args: argparse.Namespace, device: str, elapsed_s: float
) -> str:
    """The paragraph under the title: model, batch, steps, software, machine."""
    ok = [row for row in rows.values() if row["status"] == "ok"]
    if not ok:
        return "No contender ran."
    preset = PRESETS[args.model]
    threads = ok[-1]["ranks"][0]["threads"]
    return (
        f"{ok[0]['n_params'] / 1e6:.2f}M parameters ({ok[0]['param_bytes'] / report.MiB:.2f} MiB "
        f"fp32), per-rank batch {preset.per_rank_batch} x {preset.seq_len} tokens, AdamW, "
        f"{args.warmup} warm-up + {args.steps} timed steps + 1 profiled step; torch "
        f"{torch.__version__}, {os.cpu_count()} cores, {threads} thread(s) per process, "
        f"{platform.node()}, {datetime.datetime.now():%Y-%m-%d %H:%M}; total {elapsed_s:.0f} s."
        + (f" zero3 options: {args.zero3_options}." if json.loads(args.zero3_options) else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device, args.world, args.model)
    run_dir = os.path.join(args.out, f"compare-{args.model}-w{args.world}-{device}")
    log_dir = os.path.join(run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    chosen = args.contenders.split(",")
    order = [REFERENCE] if REFERENCE in chosen else []
    order += [name for name in chosen if name != REFERENCE]
    rows: dict[str, dict] = {}
    start = time.perf_counter()
    for i, name in enumerate(order, 1):
        print(f"[{i}/{len(order)}] {name}: {CONTENDERS[name].description} ...", flush=True)
        began = time.perf_counter()
        rows[name] = run_one(name, args, device, log_dir)
        print(f"  {rows[name]['status']} ({time.perf_counter() - began:.0f} s)", flush=True)
    table = report.render_markdown(
        rows,
        title=f"compare.py: {args.model}, {args.world} ranks, {device}",
        description=describe_run(rows, args, device, time.perf_counter() - start),
        world=args.world,
        device=device,
        reference=REFERENCE,
        baseline=SPEED_BASELINE,
    )
    print()
    print(table)
    data = {"args": vars(args), "device": device, "torch": torch.__version__, "contenders": rows}
    chart_title = f"{args.model}, {args.world} ranks, {device}"
    report.write_run(
        run_dir,
        ("results.md", table),
        ("results.json", data),
        ("chart.png", lambda path: report.write_chart(path, rows, chart_title)),
    )
    checked = rows.get(REFERENCE, {}).get("status") == "ok"
    verdicts = report.check_losses(rows, REFERENCE).values() if checked else []
    return 1 if any(v["verdict"] == "void" for v in verdicts) else 0  # a wrong result fails


if __name__ == "__main__":
    sys.exit(main())
