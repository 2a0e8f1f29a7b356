"""Offload tiers side by side: no offload, parameters on disk, optimizer state on disk, both.

    python -m bench.offload --world 2                    # gpt-small, 2 CPU ranks, eager codegen
    python -m bench.offload --world 2 --codegen inductor --steps 10

Per configuration, in fresh processes, the same model, batches and AdamW: median step time
(forward + backward + step), resident anonymous memory after the timed steps (RssAnon, after
glibc hands freed memory back), bytes read and written per step, the time the I/O threads were
busy, and the share of it the step waited for (exposed) rather than spent computing beside it.
Writes a markdown table to stdout and JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from bench.harness.disk import offload_stores
from bench.harness.launch import run_ranks, set_rank_threads
from bench.harness.models import PRESETS, build_model, global_batch, lm_loss, rank_slice
from bench.harness.paths import results_dir
from bench.harness.proc import settle, status_kib

CONFIGS = {
    "none": (None, None),
    "params-disk": ("disk", None),
    "optimizer-disk": (None, "disk"),
    "both-disk": ("disk", "disk"),
}


def _run(rank: int, world: int, args: dict) -> dict:
    import zero3_compile as z3

    set_rank_threads(world)
    dist.init_process_group("gloo")
    params_tier, opt_tier = CONFIGS[args["config"]]
    preset = PRESETS[args["model"]]
    model = build_model(preset, args["seed"], "cpu")
    folder = args["path"]
    offload = z3.Offload(params=params_tier, path=folder) if params_tier else None
    z3.shard(model, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if opt_tier:
        opt = z3.offload_optimizer(opt, tier=opt_tier, path=folder, read_ahead=args["read_ahead"])
    step_model = torch.compile(model, backend="zero3", options={"codegen": args["codegen"]})
    times, losses = [], []
    counters = {}
    for step in range(args["warmup"] + args["steps"]):
        if step == args["warmup"]:
            stores = offload_stores(model, opt)
            counters = {
                "read": sum(s.bytes_read for s in stores),
                "written": sum(s.bytes_written for s in stores),
                "io": sum(s.io_seconds for s in stores),
                "wait": sum(s.wait_seconds for s in stores),
            }
        batch = rank_slice(
            global_batch(preset, world, step, args["seed"]), rank, preset.per_rank_batch
        )
        dist.barrier()
        start = time.perf_counter()
        loss = lm_loss(step_model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    stores = offload_stores(model, opt)
    timed = args["steps"]
    settle()
    io = sum(s.io_seconds for s in stores) - counters.get("io", 0.0)
    wait = sum(s.wait_seconds for s in stores) - counters.get("wait", 0.0)
    return {
        "median_step_ms": 1e3 * statistics.median(times[args["warmup"] :]),
        "rss_anon_mib": (status_kib("RssAnon") or 0) * 1024 / 2**20,
        "read_mib_per_step": (sum(s.bytes_read for s in stores) - counters.get("read", 0))
        / 2**20
        / timed,
        "written_mib_per_step": (sum(s.bytes_written for s in stores) - counters.get("written", 0))
        / 2**20
        / timed,
        "io_ms_per_step": 1e3 * io / timed,
        "exposed_io_ms_per_step": 1e3 * wait / timed,
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", choices=sorted(PRESETS), default="gpt-small")
    parser.add_argument("--codegen", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--read-ahead", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--path", default=None, help="folder for the disk tier (default: a temp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="MALLOC_MMAP_THRESHOLD_ for the ranks (0: glibc's default, dynamic)",
    )
    parser.add_argument("--out", default=results_dir())
    args = parser.parse_args(argv)
    rows = {}
    for name in args.configs.split(","):
        folder = args.path or tempfile.mkdtemp(prefix="zero3-bench-offload-")
        spec = {
            "config": name,
            "model": args.model,
            "codegen": args.codegen,
            "warmup": args.warmup,
            "steps": args.steps,
            "read_ahead": args.read_ahead,
            "path": folder,
            "seed": args.seed,
        }
        per_rank = run_ranks(
            _run,
            args.world,
            (spec,),
            log_dir=os.path.join(args.out, "logs"),
            name=f"offload-{name}",
            timeout_s=3600,
            # a fixed mmap threshold: freed tensors go back to the system, so RssAnon shows what
            # is live (glibc otherwise raises the threshold and keeps freed memory for reuse)
            env={"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
            if args.mmap_threshold
            else None,
        )
        rows[name] = per_rank
        print(f"{name}: done", file=sys.stderr)
    base = max(r["median_step_ms"] for r in rows["none"]) if "none" in rows else None
    print(
        f"\n{args.model}, {args.world} ranks, codegen={args.codegen}, AdamW, "
        f"{args.steps} timed steps, read-ahead {args.read_ahead}, "
        f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'default'}; torch {torch.__version__}\n"
    )
    print(
        "| configuration | median step ms (max rank) | vs none | RssAnon MiB (max rank) | "
        "read MiB/step | written MiB/step | I/O ms/step | exposed I/O ms/step (share) | "
        "losses equal to none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    reference = [r["losses"] for r in rows.get("none", [])]
    for name, per_rank in rows.items():
        step = max(r["median_step_ms"] for r in per_rank)
        io = max(r["io_ms_per_step"] for r in per_rank)
        exposed = max(r["exposed_io_ms_per_step"] for r in per_rank)
        share = f"{exposed / io:.0%}" if io else "-"
        same = "yes" if not reference or [r["losses"] for r in per_rank] == reference else "NO"
        print(
            f"| {name} | {step:.0f} | {step / base:.2f}x | "
            f"{max(r['rss_anon_mib'] for r in per_rank):.0f} | "
            f"{max(r['read_mib_per_step'] for r in per_rank):.1f} | "
            f"{max(r['written_mib_per_step'] for r in per_rank):.1f} | {io:.0f} | "
            f"{exposed:.0f} ({share}) | {same} |"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"offload-{args.model}-w{args.world}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
