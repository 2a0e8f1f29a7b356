"""Per-contender summaries from the ranks' raw results, the markdown tables, JSON and chart."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from typing import Any

from .comm import zero3_ideal_ring_bytes

MiB = 1 << 20
# Max relative deviation of a loss from the reference trajectory. Reordered fp32 sums (other
# reduction orders, Inductor's fusions) stay around 1e-6 over tens of steps; beyond AGREE the
# contender computes something else than the reference, beyond VOID its figures are void.
AGREE_TOLERANCE = 1e-4
VOID_TOLERANCE = 1e-3


def summarize(ranks: list[dict[str, Any]], warmup: int, comm_source: str) -> dict[str, Any]:
    """Figures of one contender: rank 0's and the worst rank's, plus the global loss per step."""
    steady = [r["times_s"][warmup:] for r in ranks]
    medians = [statistics.median(s) for s in steady]
    minima = [min(s) for s in steady]
    compile_s = [r["times_s"][0] - m for r, m in zip(ranks, medians)]
    persistent = [sum(r["state"].values()) for r in ranks]
    # every rank has the same batch size, so the mean of the ranks' losses is the global loss
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks))]
    use_graphs = comm_source == "graphs" and "comm_graphs" in ranks[0]
    comm = ranks[0]["comm_graphs"] if use_graphs else ranks[0]["comm_profile"]
    rss_steady = [r["rss_hwm_steady"] for r in ranks if r["rss_hwm_steady"] is not None]
    return {
        "status": "ok",
        "step_s": {
            "rank0_median": medians[0],
            "max_median": max(medians),
            "rank0_min": minima[0],
            "max_min": max(minima),
        },
        "compile_s": {"rank0": compile_s[0], "max": max(compile_s)},
        "setup_s": max(r["setup_s"] for r in ranks),
        "state_bytes": {"rank0": ranks[0]["state"], "max_total": max(persistent)},
        "alloc_peak_bytes": {
            "rank0": ranks[0]["memory"]["peak"],
            "max": max(r["memory"]["peak"] for r in ranks),
            "rank0_at_step_start": ranks[0]["memory"]["start"],
            "rank0_transient": ranks[0]["memory"]["transient"],
        },
        "rss_hwm_bytes": {
            "steady_rank0": ranks[0]["rss_hwm_steady"],
            "steady_max": max(rss_steady) if rss_steady else None,
            "with_compile_max": max((r["rss_hwm_warmup"] or 0) for r in ranks) or None,
        },
        "comm": {
            **comm,
            "method": "compiled graphs" if use_graphs else "profiler (c10d ops)",
            "profiler_agrees": _same_collectives(ranks[0]["comm_profile"], comm),
        },
        "losses": losses,
        "n_params": ranks[0]["n_params"],
        "param_bytes": ranks[0]["param_bytes"],
        "ranks": ranks,
    }


def _same_collectives(a: dict, b: dict) -> bool:
    return a["by_kind"] == b["by_kind"]


def check_losses(rows: dict[str, dict], reference: str) -> dict[str, dict[str, float]]:
    """Max absolute and relative deviation of each trajectory from the reference one."""
    ref = rows[reference]["losses"]
    out = {}
    for name, row in rows.items():
        if row.get("status") != "ok" or name == reference:
            continue
        diffs = [abs(a - b) for a, b in zip(row["losses"], ref)]
        rel = [d / max(abs(b), 1e-12) for d, b in zip(diffs, ref)]
        worst = max(rel)
        first = next((i for i, r in enumerate(rel) if r > AGREE_TOLERANCE), None)
        out[name] = {
            "max_abs": max(diffs),
            "max_rel": worst,
            "first_step_beyond_agree": first,
            "verdict": "void"
            if worst > VOID_TOLERANCE
            else "deviates"
            if first is not None
            else "agrees",
        }
    return out


# --------------------------------------------------------------------------- markdown


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:.2f}"


def _pair(a: str, b: str) -> str:
    return a if a == b else f"{a} / {b}"


def speed_table(rows: dict[str, dict], baseline: str) -> str:
    base = rows.get(baseline, {}).get("step_s", {}).get("max_median")
    lines = [
        "| contender | median step ms (rank 0 / max) | min step ms (rank 0 / max) "
        f"| vs {baseline} | compile s (rank 0 / max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in _ok(rows):
        s, c = row["step_s"], row["compile_s"]
        ratio = f"{s['max_median'] / base:.2f}x" if base else "n/a"
        median = _pair(f"{s['rank0_median'] * 1e3:.1f}", f"{s['max_median'] * 1e3:.1f}")
        fastest = _pair(f"{s['rank0_min'] * 1e3:.1f}", f"{s['max_min'] * 1e3:.1f}")
        compile_s = _pair(f"{c['rank0']:.1f}", f"{c['max']:.1f}")
        lines.append(f"| {name} | {median} | {fastest} | {ratio} | {compile_s} |")
    return "\n".join(lines)


def memory_table(rows: dict[str, dict]) -> str:
    lines = [
        "| contender | params | grads | optimizer | persistent (rank 0 / max) "
        "| allocator peak (rank 0 / max) | of which step transient | RSS HWM steady (rank 0 / max) "
        "| RSS HWM to end of warm-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in _ok(rows):
        state = row["state_bytes"]["rank0"]
        peak, rss = row["alloc_peak_bytes"], row["rss_hwm_bytes"]
        lines.append(
            f"| {name} | {_mib(state['params'])} | {_mib(state['grads'])} "
            f"| {_mib(state['optimizer'])} "
            f"| {_pair(_mib(sum(state.values())), _mib(row['state_bytes']['max_total']))} "
            f"| {_pair(_mib(peak['rank0']), _mib(peak['max']))} | {_mib(peak['rank0_transient'])} "
            f"| {_pair(_mib(rss['steady_rank0']), _mib(rss['steady_max']))} "
            f"| {_mib(rss['with_compile_max'])} |"
        )
    return "\n".join(lines)


def comm_table(rows: dict[str, dict], ideal_bytes: int) -> str:
    kinds = ["all_gather", "reduce_scatter", "all_reduce", "broadcast"]
    header = " | ".join(f"{k.replace('_', '-')} n / MiB" for k in kinds)
    lines = [
        f"| contender | source | {header} | ring MiB / rank | vs ZeRO-3 ideal |",
        "|---|---|" + "---:|" * (len(kinds) + 2),
    ]
    for name, row in _ok(rows):
        comm = row["comm"]
        if not comm["by_kind"]:
            lines.append(f"| {name} | {comm['method']} |" + " - |" * (len(kinds) + 2))
            continue
        cells = []
        for kind in kinds:
            entry = comm["by_kind"].get(kind)
            cells.append(f"{entry['count']} / {_mib(entry['bytes'])}" if entry else "-")
        others = sorted(set(comm["by_kind"]) - set(kinds))
        source = comm["method"]
        if comm["method"] == "compiled graphs":
            source += " (profiler agrees)" if comm["profiler_agrees"] else " (profiler differs)"
        if others:
            source += f"; also {', '.join(others)}"
        ratio = f"{comm['ring_bytes_per_rank'] / ideal_bytes:.2f}x" if ideal_bytes else "n/a"
        lines.append(
            f"| {name} | {source} | {' | '.join(cells)} "
            f"| {_mib(comm['ring_bytes_per_rank'])} | {ratio} |"
        )
    return "\n".join(lines)


def loss_table(rows: dict[str, dict], deviations: dict[str, dict], reference: str) -> str:
    lines = [
        f"| contender | final loss | max abs dev. from {reference} | max rel. dev. | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for name, row in _ok(rows):
        dev = deviations.get(name)
        if dev is None:
            lines.append(f"| {name} | {row['losses'][-1]:.5f} | (reference) | | |")
            continue
        verdict = {
            "agrees": "agrees",
            "deviates": f"**DEVIATES from step {dev['first_step_beyond_agree']}**",
            "void": f"**VOID: WRONG RESULT (from step {dev['first_step_beyond_agree']})**",
        }[dev["verdict"]]
        lines.append(
            f"| {name} | {row['losses'][-1]:.5f} | {dev['max_abs']:.2e} | {dev['max_rel']:.2e} "
            f"| {verdict} |"
        )
    return "\n".join(lines)


def not_measured(rows: dict[str, dict]) -> list[str]:
    return [f"- {name}: {row['status']}" for name, row in rows.items() if row["status"] != "ok"]


def _ok(rows: dict[str, dict]):
    return [(name, row) for name, row in rows.items() if row.get("status") == "ok"]


def loss_banner(rows: dict[str, dict], deviations: dict[str, dict], reference: str) -> str:
    """A loud line when a contender left the reference trajectory (or nothing was checked)."""
    if rows.get(reference, {}).get("status") != "ok":
        return f"**!!! The {reference} reference did not run: loss agreement NOT checked. !!!**"
    void = [n for n, d in deviations.items() if d["verdict"] == "void"]
    deviating = [n for n, d in deviations.items() if d["verdict"] == "deviates"]
    parts = []
    if void:
        parts.append(
            f"**!!! VOID: {', '.join(void)} left the {reference} loss trajectory (relative "
            f"deviation > {VOID_TOLERANCE:g}): their figures measure a different computation. !!!**"
        )
    if deviating:
        parts.append(
            f"**!!! WARNING: {', '.join(deviating)} deviate(s) from the {reference} loss "
            f"trajectory by more than {AGREE_TOLERANCE:g} (relative), far above fp32 rounding. !!!**"
        )
    return "\n\n".join(parts)


def render_markdown(
    rows: dict[str, dict],
    *,
    title: str,
    description: str,
    world: int,
    device: str,
    reference: str,
    baseline: str,
) -> str:
    """The whole report: speed, memory, communication and loss agreement tables."""
    ok = [row for _, row in _ok(rows)]
    param_bytes = ok[0]["param_bytes"] if ok else 0
    ideal = zero3_ideal_ring_bytes(param_bytes, world)
    has_reference = rows.get(reference, {}).get("status") == "ok"
    deviations = check_losses(rows, reference) if has_reference else {}
    banner = loss_banner(rows, deviations, reference)
    if device == "cuda":
        peak_note = "Allocator peak: torch.cuda.max_memory_allocated over the profiled step."
    else:
        peak_note = (
            "Allocator peak: tensor bytes live when the profiled step starts (gc scan of tensor "
            "storages, plus DDP's C++-held gradient buckets) + the step's highest transient level, "
            "replayed from torch.profiler memory events. RSS HWM: the process's VmHWM over the "
            "timed steps (steady; reset after warm-up) and from process start to the end of "
            "warm-up (compilation included)."
        )
    if "deepspeed" in rows or "deepspeed-compiled" in rows:
        peak_note += (
            " DeepSpeed allocates its gradient bucket at the default reduce_bucket_size (5e8 "
            "elements, 1.86 GiB fp32) up front; it counts in the allocator peak, while on CPU only "
            "its touched pages become resident (RSS)."
        )
    parts = [
        f"# {title}",
        description,
        banner,
        "## Step time",
        speed_table(rows, baseline),
        "Step = forward + backward + optimizer step, all ranks starting together (barrier); "
        "max = the slowest rank. Compile = first step minus the steady median (for eager "
        "contenders: first-step overhead).",
        "## Memory per rank (MiB)",
        memory_table(rows),
        "params / grads / optimizer: bytes of the tensors rank 0 holds (DTensor shards, "
        "DeepSpeed's partitions and persistent parameters). " + peak_note,
        "## Communication per step (rank 0)",
        comm_table(rows, ideal),
        f"ZeRO-3 ideal per rank: 3 psi (N-1)/N = {ideal / MiB:.2f} MiB (psi = "
        f"{param_bytes / MiB:.2f} MiB of parameters); DDP's all-reduce ideal is 2 psi (N-1)/N. "
        "Logical bytes: all-gather output, reduce-scatter input, all-reduce tensor; ring MiB = "
        "what one rank sends on a ring. gloo runs each reduce-scatter as an all-reduce of the "
        "whole input underneath, so on CPU the wire carries more than the logical figure.",
        "## Loss agreement",
        loss_table(rows, deviations, reference) if has_reference else "(no reference)",
    ]
    skipped = not_measured(rows)
    if skipped:
        parts += ["## Not measured", "\n".join(skipped)]
    parts.append(banner)
    return "\n\n".join(p for p in parts if p) + "\n"


# --------------------------------------------------------------------------- files


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def write_run(
    run_dir: str,
    text: tuple[str, str],
    data: tuple[str, dict[str, Any]],
    chart: tuple[str, Callable[[str], str | None]],
) -> None:
    """A run's markdown ``(name, text)``, JSON ``(name, data)`` and chart ``(name, draw)`` into
    ``run_dir``, then a line saying what was written (``draw(path)`` returns why not, or None).

    Example:
        write_run(run_dir, ("results.md", table), ("results.json", data),
                  ("chart.png", lambda path: write_chart(path, rows, title)))
    """
    with open(os.path.join(run_dir, text[0]), "w") as f:
        f.write(text[1])
    write_json(os.path.join(run_dir, data[0]), data[1])
    why_not = chart[1](os.path.join(run_dir, chart[0]))
    print(f"wrote {run_dir}/{text[0]}, {data[0]}" + ("" if why_not else f", {chart[0]}"))
    if why_not:
        print(f"chart skipped: {why_not}")


def print_ranks(title: str, results: list[dict], args) -> None:
    """``title``, then each rank's result as one JSON line; all of it (with ``args``) into the
    file ``args.json`` names, when it names one.

    Example:
        print_ranks("rollout export, 2 ranks", run_ranks(fn, 2, (cfg,)), args)
    """
    print(title)
    for out in results:
        print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": results}, f, indent=2)


def write_chart(path: str, rows: dict[str, dict], title: str) -> str | None:
    """Step time and memory bars per contender; returns why not if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no chart written"
    ok = _ok(rows)
    if not ok:
        return "no contender ran; no chart written"
    names = [name for name, _ in ok]
    positions = list(range(len(names)))
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 2))
    medians = [row["step_s"]["max_median"] * 1e3 for _, row in ok]
    minima = [row["step_s"]["max_min"] * 1e3 for _, row in ok]
    ax_time.barh(positions, medians, color="tab:blue", label="median (slowest rank)")
    ax_time.scatter(minima, positions, color="black", marker="|", s=200, label="min", zorder=3)
    ax_time.set_xlabel("step time, ms")
    ax_time.legend(loc="lower right")
    height = 0.4
    persistent = [row["state_bytes"]["max_total"] / MiB for _, row in ok]
    peaks = [row["alloc_peak_bytes"]["max"] / MiB for _, row in ok]
    ax_mem.barh([p - height / 2 for p in positions], persistent, height, label="persistent state")
    ax_mem.barh([p + height / 2 for p in positions], peaks, height, label="allocator peak")
    if max(peaks) > 50 * min(persistent):  # one outlier would flatten every other bar
        ax_mem.set_xscale("log")
    ax_mem.set_xlabel("MiB per rank (max over ranks)")
    ax_mem.legend(loc="lower right")
    for ax in (ax_time, ax_mem):
        ax.set_yticks(positions, names)
        ax.invert_yaxis()
    ax_mem.set_yticklabels([])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
