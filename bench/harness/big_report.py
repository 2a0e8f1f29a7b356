"""big_model.py's report: per contender and phase, seconds, peak RSS, bytes moved, exposed I/O,
the disk's busy share and CPU time; the steady step against its compute and disk bounds.

Example:
    text = report(args, SHAPES["llama-3b"], disk_bandwidth(scratch), runs, compute_s)
"""

from __future__ import annotations

import torch

from .disk import STREAMS
from .llama import config_of


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _busy(record: dict) -> str:
    """The share of a phase the scratch disk had requests in flight (any process's)."""
    busy = record.get("disk_busy_s", 0.0)
    return f"{busy / record['seconds']:.0%}" if busy and record["seconds"] else "-"


def report(args, shape, disk, runs, compute) -> str:
    """The markdown report of a big_model.py run: ``args`` its arguments, ``disk`` the bandwidth
    test (None when skipped), ``runs`` each contender's per-rank results, ``compute`` the step
    time without I/O (None when not measured)."""
    import transformers

    config = config_of(shape)
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    state_gb = params * 16 / 1e9  # fp32 parameters, gradients, Adam's two moments
    lines = [
        f"# big_model: {args.model} ({shape.layers} layers), {params / 1e9:.2f}B parameters ({state_gb:.1f} GB of fp32 "
        f"parameters + gradients + AdamW); {args.world} ranks, {args.seq} tokens per rank and "
        f"step, offload {args.offload} (gradients {args.grads}, "
        f"{'one copy' if args.single_copy else 'two copies'} on disk{', O_DIRECT' if args.o_direct else ''}), codegen {args.codegen}, bf16 {args.bf16}, THP {args.thp}, optimizer in backward {args.in_backward}, fused AdamW {args.fused_adamw}, I/O threads per store {args.io_threads}"
        f"{f', GIL switch interval {args.switch_interval * 1e3:g} ms' if args.switch_interval else ''}"
        f"{'; zero3 options ' + args.zero3_options if args.zero3_options else ''}; torch "
        f"{torch.__version__}",
        "",
    ]
    if disk:
        lines.append(
            f"Disk (O_DIRECT, 16 MiB blocks, the best of {', '.join(map(str, STREAMS))} streams): "
            f"write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s; reading and "
            f"writing at once {disk['mixed_gbps']:.2f} GB/s together (streams: "
            + ", ".join(f"{k.split('_')[0]} {v}" for k, v in disk.get("streams", {}).items())
            + ")."
        )
        if "after" in disk:
            after = disk["after"]
            lines.append(
                f"Measured again after the runs: write {after['write_gbps']:.2f} GB/s, read "
                f"{after['read_gbps']:.2f} GB/s, at once {after['mixed_gbps']:.2f} GB/s."
            )
        lines.append("")
    for name, per_rank in runs.items():
        lines += [f"## {name}", "", "| phase | seconds | peak RSS GB (rank 0 / 1 / sum) | "
                  "read GB | written GB | I/O s (threads) | exposed I/O s | disk busy | "
                  "CPU s, training thread / others (rank 0) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for phase in per_rank[0]["phases"]:
            records = [r["phases"][phase] for r in per_rank]
            peaks = [r.get("peak_rss") for r in records]  # a part of "steps" has none
            memory = "-" if None in peaks else " / ".join(map(_gb, peaks)) + f" / {_gb(sum(peaks))}"
            lines.append(
                f"| {phase} | {max(r['seconds'] for r in records):.1f} | {memory} | "
                f"{_gb(sum(max(r['store_read'], r['disk_read']) for r in records))} | "
                f"{_gb(sum(max(r['store_written'], r['disk_written']) for r in records))} | "
                f"{max(r['io_s'] for r in records):.1f} | {max(r['wait_s'] for r in records):.1f} | "
                f"{_busy(records[0])} | "
                f"{records[0]['cpu_main_s']:.1f} / "
                f"{records[0]['cpu_s'] - records[0]['cpu_main_s']:.1f} |"
            )
        losses = per_rank[0].get("losses")
        if losses:
            lines.append(f"\nlosses {', '.join(f'{x:.4f}' for x in losses)}")
        if "in_backward" in per_rank[0]:
            parts = [r["in_backward"] for r in per_rank]

            def each(key: str, fmt: str = "{:.1f}", parts=parts) -> str:
                return ", ".join(fmt.format(p[key]) for p in parts)

            lines.append(
                "in the backward, over all steps, per rank: training waited for the stepping "
                f"thread {each('waited_s')} s; the stepping thread waited for its I/O "
                f"{each('stepper_waited_s')} s; shard values taken from the backward's reloads "
                f"{each('reused_gb', '{:.2f}')} GB"
            )
        if "host_cache" in per_rank[0]:
            caches = [r["host_cache"] for r in per_rank]
            lines.append(
                "host cache (blocks of 1 MiB and more), per rank: served from kept blocks "
                + ", ".join(f"{c['hits']}" for c in caches)
                + "; newly mapped "
                + ", ".join(f"{c['misses']}" for c in caches)
                + "; most in use "
                + ", ".join(f"{c['peak_live_bytes'] / 1e9:.2f}" for c in caches)
                + " GB"
            )
        elif name.startswith("zero3"):
            lines.append("host cache: not used (ZERO3_HOST_CACHE_MB=0, or another allocator)")
        steps = per_rank[0]["phases"].get("steps")
        if steps and per_rank[0]["steps"] > 1:
            step_s = max(r["phases"]["steps"]["seconds"] for r in per_rank) / (
                per_rank[0]["steps"] - 1
            )
            # the offload stores' counters; a contender without them (DeepSpeed's swapper):
            # the process's own (/proc/self/io)
            steps_of = [r["phases"]["steps"] for r in per_rank]
            moved_read = sum(max(p["store_read"], p["disk_read"]) for p in steps_of)
            moved_written = sum(max(p["store_written"], p["disk_written"]) for p in steps_of)
            n = per_rank[0]["steps"] - 1
            io_bound = 0.0
            if disk:
                io_bound = (moved_read / n) / (disk["read_gbps"] * 1e9) + (moved_written / n) / (
                    disk["write_gbps"] * 1e9
                )
            bound = max(compute or 0.0, io_bound)
            lines.append(
                f"step {step_s:.1f} s; compute alone {compute or float('nan'):.1f} s; disk "
                f"{io_bound:.1f} s for {_gb(moved_read / n)} GB read + {_gb(moved_written / n)} "
                f"GB written per step; bound {bound:.1f} s; step / bound "
                f"{step_s / bound if bound else float('nan'):.2f}"
            )
            if disk:  # the same bytes at the rate of reads and writes at once
                mixed = (moved_read + moved_written) / n / (disk["mixed_gbps"] * 1e9)
                lines.append(
                    f"the same bytes read and written at once: {mixed:.1f} s; step / "
                    f"max(compute, that) {step_s / max(compute or 0.0, mixed):.2f}"
                )
        if "io_trace" in per_rank[0] and steps:
            traces = [r["io_trace"] for r in per_rank]
            steps_s = max(r["phases"]["steps"]["seconds"] for r in per_rank)
            last_s = steps_s / (per_rank[0]["steps"] - 1)
            lines.append(
                "the steady steps' store transfers, per rank: "
                + "; ".join(
                    f"{t['transfers']} transfers (median {t['median_bytes'] / 2**20:.1f} MiB), "
                    f"{_gb(t['read'])} GB read + {_gb(t['written'])} GB written, some in flight "
                    f"{t['busy_s']:.1f} s of {steps_s:.1f} ({t['mean_in_flight']:.1f} on average)"
                    for t in traces
                )
            )
            replays = list(zip(*(t["replays"] for t in traces)))  # per replay, each rank's
            lines.append(
                "the last step's transfers replayed on the same files with nothing else running "
                "(both ranks at once, each store's threads; in turn as traced and sorted by "
                "offset): "
                + "; ".join(
                    f"{rs[0]['order']} {max(r['seconds'] for r in rs):.1f} s "
                    f"({sum(r['bytes'] for r in rs) / max(r['seconds'] for r in rs) / 1e9:.2f} "
                    "GB/s)"
                    for rs in replays
                )
                + f"; the step took {last_s:.1f} s (mean of the steady steps)"
            )
        load = per_rank[0]["phases"].get("load")
        if load and disk:
            read = sum(max(r["phases"]["load"]["disk_read"], 0) for r in per_rank)
            seconds = max(r["phases"]["load"]["seconds"] for r in per_rank)
            lines.append(
                f"load: {_gb(read)} GB read from disk in {seconds:.1f} s = "
                f"{read / seconds / 1e9:.2f} GB/s ({read / seconds / 1e9 / disk['read_gbps']:.0%}"
                " of the disk's read bandwidth)"
            )
        if "checkpoint_bytes" in per_rank[0]:
            save = max(r["phases"]["checkpoint save"]["seconds"] for r in per_rank)
            lines.append(
                f"checkpoint: {_gb(per_rank[0]['checkpoint_bytes'])} GB saved in {save:.1f} s "
                f"({per_rank[0]['checkpoint_bytes'] / save / 1e9:.2f} GB/s)"
            )
        if "killed" in per_rank[0]:
            lines.append(per_rank[0]["killed"])
        if "resume" in per_rank[0]:
            lines.append(per_rank[0]["resume"])
        lines.append("")
    return "\n".join(lines)
