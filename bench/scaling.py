"""Per-rank memory against world size: does each rank's share fall as 1/N?

    python -m bench.scaling                    # gpt-small, worlds 1 2 4 8, zero3 and fsdp2
    python -m bench.scaling --quick            # small GPT, eager codegen: a minute or two
    python -m bench.scaling --worlds 1,2,4,8,16 --contenders zero3,zero3-eager-codegen,fsdp2

Memory needs no real peers: one process joins the ``fake`` process group as rank 0 of N
(collectives return at once, their output buffers are still allocated), so any N runs on one
machine. Each rank trains on the same per-rank batch (weak scaling), so activations stay
constant while parameters, gradients and optimizer state should shrink as 1/N. Step times and
losses of the fake group mean nothing and are not reported. Writes a table, JSON and a chart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench.harness import report
from bench.harness.contenders import CONTENDERS
from bench.harness.models import PRESETS
from bench.harness.orchestrate import run_spec
from bench.harness.paths import results_dir
from bench.harness.runner import RunSpec

MiB = report.MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(PRESETS), default="gpt-small")
    parser.add_argument("--quick", action="store_true", help="small GPT, eager codegen")
    parser.add_argument("--worlds", default="1,2,4,8", help="comma-separated world sizes")
    parser.add_argument("--contenders", help="comma-separated (default: zero3,fsdp2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", default=results_dir())
    args = parser.parse_args(argv)
    if args.quick:
        args.model = "quick"
    args.contenders = (
        args.contenders or ("zero3-eager-codegen,fsdp2" if args.quick else "zero3,fsdp2")
    ).split(",")
    unknown = [c for c in args.contenders if c not in CONTENDERS or not CONTENDERS[c].distributed]
    if unknown:
        parser.error(f"not sharded contenders or unknown: {unknown}")
    if any(CONTENDERS[c].requires for c in args.contenders):
        parser.error("the fake process group cannot host DeepSpeed")
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if PRESETS[args.model].gpu_only and args.device != "cuda":
        parser.error(f"the {args.model} preset is GPU only")
    return args


def measure(args: argparse.Namespace, log_dir: str) -> dict[str, dict[int, dict]]:
    """{contender: {world: figures}} from one fake-group process per point."""
    results: dict[str, dict[int, dict]] = {}
    for name in args.contenders:
        results[name] = {}
        for world in args.worlds:
            print(f"{name} at world {world} ...", flush=True)
            spec = RunSpec(
                contender=name,
                preset=args.model,
                world=world,
                device=args.device,
                backend="fake",
                warmup=1,
                steps=1,
                seed=0,
                threads=args.threads,
            )
            row = run_spec(
                spec,
                log_dir=log_dir,
                timeout_s=args.timeout,
                log_name=f"{name}-w{world}",
            )
            if row["status"] != "ok":
                print(f"  {row['status']}")
                results[name][world] = {"status": row["status"]}
                continue
            results[name][world] = {
                "status": "ok",
                "persistent": row["state_bytes"]["rank0"],
                "persistent_total": row["state_bytes"]["max_total"],
                "peak": row["alloc_peak_bytes"]["rank0"],
                "transient": row["alloc_peak_bytes"]["rank0_transient"],
                "rss_steady": row["rss_hwm_bytes"]["steady_rank0"],
            }
    return results


def ideal(points: dict[int, dict], key: str, world: int) -> float | None:
    """The world-size-1 figure divided by N. For the peak: the state live when the step starts
    (parameters, optimizer state) shrinks as 1/N, the step's transient (activations, gradients
    as they are produced) stays."""
    base = points.get(1, {})
    if base.get("status") != "ok":
        return None
    if key == "persistent_total":
        return base["persistent_total"] / world
    return (base["peak"] - base["transient"]) / world + base["transient"]


def table(results: dict[str, dict[int, dict]]) -> str:
    lines = [
        "| contender | world | persistent MiB | ideal (1/N) | allocator peak MiB "
        "| ideal (start state 1/N) | step transient MiB | RSS steady MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, points in results.items():
        for world, p in points.items():
            if p["status"] != "ok":
                lines.append(f"| {name} | {world} | {p['status']} | | | | | |")
                continue
            ideal_state = ideal(points, "persistent_total", world)
            ideal_peak = ideal(points, "peak", world)
            lines.append(
                f"| {name} | {world} | {p['persistent_total'] / MiB:.2f} "
                f"| {_mib(ideal_state)} | {p['peak'] / MiB:.2f} | {_mib(ideal_peak)} "
                f"| {p['transient'] / MiB:.2f} | {_mib(p['rss_steady'])} |"
            )
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.2f}"


def chart(path: str, results: dict[str, dict[int, dict]], title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no chart written"
    fig, (ax_state, ax_peak) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in results.items():
        ok = {w: p for w, p in points.items() if p["status"] == "ok"}
        worlds = sorted(ok)
        if not worlds:
            continue
        for ax, key in ((ax_state, "persistent_total"), (ax_peak, "peak")):
            (line,) = ax.plot(worlds, [ok[w][key] / MiB for w in worlds], "o-", label=name)
            ideals = [ideal(points, key, w) for w in worlds]
            if all(v is not None for v in ideals):
                ax.plot(
                    worlds,
                    [v / MiB for v in ideals],
                    "--",
                    color=line.get_color(),
                    alpha=0.6,
                    label=f"{name} ideal",
                )
    ax_state.set_title("persistent state per rank (params + grads + AdamW)")
    ax_peak.set_title("allocator peak per rank")
    for ax in (ax_state, ax_peak):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("world size N")
        ax.set_ylabel("MiB")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = os.path.join(args.out, f"scaling-{args.model}-{args.device}")
    log_dir = os.path.join(run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    start = time.perf_counter()
    results = measure(args, log_dir)
    title = f"scaling.py: {args.model} on {args.device}, fake process group"
    text = (
        f"# {title}\n\n"
        f"Rank 0 of N, per-rank batch {PRESETS[args.model].per_rank_batch} x "
        f"{PRESETS[args.model].seq_len} tokens, torch {torch.__version__}, "
        f"{time.perf_counter() - start:.0f} s. Ideal: the world-1 persistent state / N; "
        "for the peak, the world-1 peak with the state live at the step start divided by N.\n\n"
        f"{table(results)}\n"
    )
    print()
    print(text)
    report.write_run(
        run_dir,
        ("scaling.md", text),
        ("scaling.json", {"args": vars(args), "torch": torch.__version__, "results": results}),
        ("scaling.png", lambda path: chart(path, results, title)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
