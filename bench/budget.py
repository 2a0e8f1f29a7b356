"""The memory budget swept from ZeRO-3's minimum to everything kept, next to DDP and FSDP2.

    python -m bench.budget --world 2 --model gpt-small
    python -m bench.budget --world 2 --model quick --steps 10      # a minute or two

A probe run with an unlimited budget tells the planner's two ends for this model and batch: the
least memory a step needs (pure ZeRO-3, or keeping everything when that is cheaper) and what
keeping every parameter gathered from forward to backward needs. zero3 then runs at budgets spread
between them, and DDP (eager and compiled) and FSDP2 run in the same invocation. For each: median
step time, collectives per step, measured allocator peak, and the plan's estimate. Writes
budget-<model>-w<N>.md/.json (and a PNG with matplotlib) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.harness.models import PRESETS
from bench.harness.orchestrate import run_spec
from bench.harness.paths import results_dir
from bench.harness.runner import RunSpec

MiB = 2**20
BASELINES = ("ddp", "ddp-compiled", "fsdp2")


def _spec(args, contender: str, options: dict) -> RunSpec:
    return RunSpec(
        contender=contender,
        preset=args.model,
        world=args.world,
        device="cpu",
        backend="gloo",
        warmup=args.warmup,
        steps=args.steps,
        seed=0,
        threads=args.threads,
        zero3_options=json.dumps(options),
    )


def _run(args, contender: str, options: dict, name: str) -> dict:
    print(f"{name} ...", file=sys.stderr, flush=True)
    logs = os.path.join(args.out, "logs")
    row = run_spec(_spec(args, contender, options), log_dir=logs, timeout_s=3600, log_name=name)
    if row.get("status") != "ok":
        raise SystemExit(f"budget.py: {name} failed: {row.get('status')}")
    return row


def _figures(row: dict) -> dict:
    plans = row["ranks"][0].get("budget_plans") or []
    by_kind = row["comm"]["by_kind"]
    return {
        "step_ms": row["step_s"]["max_median"] * 1e3,
        "all_gathers": by_kind.get("all_gather", {}).get("count", 0),
        "gathered_mib": by_kind.get("all_gather", {}).get("bytes", 0) / MiB,
        "collectives": row["comm"]["count"],
        "ring_mib": row["comm"]["ring_bytes_per_rank"] / MiB,
        "peak_mib": row["alloc_peak_bytes"]["max"] / MiB,
        "persistent_mib": row["state_bytes"]["max_total"] / MiB,
        "estimated_mib": plans[0]["estimated"] / MiB if plans else None,
        "kept": f"{len(plans[0]['kept'])}/{plans[0]['candidates']}" if plans else "-",
        "losses": row["losses"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=sorted(PRESETS), default="gpt-small")
    parser.add_argument("--points", type=int, default=4, help="budgets, both ends included")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=results_dir())
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    probe = _run(args, "zero3", {"memory_budget_mb": 1e9}, "budget-probe")
    plan = probe["ranks"][0]["budget_plans"][0]
    low, high = plan["minimum"], plan["estimated"]
    budgets = sorted({low + (high - low) * i / max(1, args.points - 1) for i in range(args.points)})
    rows: dict[str, dict] = {"zero3 (no budget)": _figures(_run(args, "zero3", {}, "budget-none"))}
    for budget in budgets:
        name = f"zero3 budget {budget / MiB:.1f} MiB"
        rows[name] = _figures(
            _run(args, "zero3", {"memory_budget_mb": budget / MiB}, f"budget-{budget / MiB:.0f}")
        )
    for baseline in BASELINES:
        rows[baseline] = _figures(_run(args, baseline, {}, f"budget-{baseline}"))

    ddp = rows["ddp"]
    ref_losses = rows["zero3 (no budget)"]["losses"]
    lines = [
        f"{args.model}, {args.world} CPU ranks (gloo), AdamW, {args.warmup} warm-up + "
        f"{args.steps} timed steps, torch {torch.__version__}; the planner's range: "
        f"{low / MiB:.1f} MiB (least) to {high / MiB:.1f} MiB (every parameter kept)",
        "",
        "| run | kept | plan estimate MiB | allocator peak MiB | median step ms | vs DDP | "
        "all-gathers | gathered MiB | ring MiB/rank | max loss deviation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in rows.items():
        deviation = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(f["losses"], ref_losses))
        estimate = f"{f['estimated_mib']:.1f}" if f["estimated_mib"] is not None else "-"
        lines.append(
            f"| {name} | {f['kept']} | {estimate} | {f['peak_mib']:.1f} | {f['step_ms']:.0f} | "
            f"{f['step_ms'] / ddp['step_ms']:.2f}x | {f['all_gathers']} | "
            f"{f['gathered_mib']:.1f} | {f['ring_mib']:.1f} | {deviation:.1e} |"
        )
    lines.append("")
    lines.append(
        "allocator peak: the profiled step's peak above nothing (persistent state included); "
        "plan estimate: the planner's persistent state + estimated step peak, optimizer state "
        "counted as 2 tensors per parameter (AdamW)."
    )
    table = "\n".join(lines)
    print(table)
    stem = os.path.join(args.out, f"budget-{args.model}-w{args.world}")
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"low": low, "high": high, "rows": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    zero3 = [f for n, f in rows.items() if n.startswith("zero3 budget")]
    ax.plot(
        [f["peak_mib"] for f in zero3],
        [f["step_ms"] for f in zero3],
        "o-",
        label="zero3, budget swept",
    )
    for name in ("zero3 (no budget)", *BASELINES):
        f = rows[name]
        ax.plot([f["peak_mib"]], [f["step_ms"]], "s", label=name)
    ax.set_xlabel("allocator peak per rank (MiB)")
    ax.set_ylabel("median step (ms)")
    ax.set_title(f"memory budget: {args.model}, {args.world} ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
