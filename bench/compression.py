"""Communication compression (ZeRO++'s qwZ, hpZ, qgZ): loss curves, bytes per step per link
class, modelled step time.

    python -m bench.compression                          # 2 ranks, gpt and llama, 200 steps
    python -m bench.compression --world 4 --ranks-per-node 2 --steps 200 --models gpt

A byte-level LM (vocab 256) trains on a fixed text corpus that ships with Python
(``pydoc_data/topics.py``: its help texts), 90% for training and 10% held out, once per
compression setting, on gloo ranks, eager codegen. For each setting: the loss curve (every step,
the mean over ranks), the held-out loss at the end, the bytes one step puts on the wire per rank
(from ``explain``: all-gathers and gradient reductions, before and after compression), and the
step time here (loopback: bytes cost little, so it is not where compression pays). The recipe:
AdamW at ``--lr`` (3e-3), ``--schedule constant`` or ``cosine`` (5% linear warmup, cosine decay to
0.1x), ``--clip`` (the gradients' global 2-norm clipped to it before each step; 0: not clipped),
``--rows`` sequences of 64 bytes per rank and step (8), ``--eval-batches`` held-out batches per
rank (16).

The ranks are laid out in nodes of ``--ranks-per-node`` k consecutive ranks (default 1: every
byte crosses the network); hpZ's settings (``secondary_shard="node"``, k from
``LOCAL_WORLD_SIZE`` as torchrun sets it, which each rank is given) run when 2 <= k < world, and
quantized gradients are then summed within each node before the nodes' sums cross them. Bytes
per link class, from ``explain``'s bytes per group: a collective over a node group (hpZ's
backward all-gathers, qgZ's sums within the node) stays within the node; every other one (the
shard group, qgZ's exchange across nodes, the replicas) crosses nodes.

Modelled step time at 100 and 400 Gbps between nodes (one link per rank, as GPU nodes have one
NIC per GPU) and 1600 Gbps within a node: ring collectives over G ranks send (G-1)/G of a
buffer's bytes per rank over the ring's slowest link, so
``comm = sum (G-1)/G * bytes / bandwidth of the link class``; ``compute`` is the measured step
time of the same model and per-rank batch on one rank (no collective); bounds:
``max(compute, comm)`` (perfect overlap) and ``compute + comm`` (none). Writes
``compression-<world>.json`` under ``--out`` (default: ``bench.harness.paths.results_dir()``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.harness.launch import run_ranks
from bench.harness.models import PRESETS, TEXT_MODELS, build_model, lm_loss, text_batch, text_corpus
from bench.harness.paths import results_dir

SETTINGS = {
    "none": {},
    "qwZ int8": {"weight_quantization": "int8"},
    "qgZ int8": {"gradient_quantization": "int8"},
    "qgZ int4": {"gradient_quantization": "int4"},
    "qwZ + qgZ int8": {"weight_quantization": "int8", "gradient_quantization": "int8"},
    "hpZ": {"secondary_shard": "node"},
    "ZeRO++ (qwZ + hpZ + qgZ int4)": {
        "weight_quantization": "int8",
        "secondary_shard": "node",
        "gradient_quantization": "int4",
    },
    # smaller blocks: a scale per 64 elements instead of 256 (int4: 4.5 bits per element, not 4.1)
    "qgZ int8 block 64": {"gradient_quantization": "int8", "quantization_block": 64},
    "qgZ int4 block 64": {"gradient_quantization": "int4", "quantization_block": 64},
    "qgZ int4 block 32": {"gradient_quantization": "int4", "quantization_block": 32},
    # the control: uncompressed, every initial weight moved by one ulp (toward +inf); how far a
    # change of the last bit alone moves the held-out loss is the floor any lossy setting's
    # single-run difference has to be read against
    "1-ulp init": {"_one_ulp": True},
}
NODE_ROLE = "node"  # explain's group role of node groups (hpZ's gathers, qgZ's first sums)
ACROSS_ROLE = "across_nodes"  # qgZ's exchange of the nodes' sums: one rank per node
INTRA_GBPS = 1600
WARMUP, FINAL_LR = 0.05, 0.1  # --schedule cosine: warmup share of the steps, final factor


def lr_factor(step: int, steps: int, schedule: str) -> float:
    """``constant``, or ``cosine``: linear warmup, then cosine decay to ``FINAL_LR`` (the last
    steps move the weights little, so the held-out loss at the end measures where training got,
    not where the last batches threw it)."""
    if schedule == "constant":
        return 1.0
    warmup = max(1, round(WARMUP * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return FINAL_LR + (1 - FINAL_LR) * 0.5 * (1 + math.cos(math.pi * progress))


def train(
    rank: int, world: int, model_name: str, setting: str, steps: int, recipe: dict, seed: int = 0
) -> dict:
    import zero3_compile as z3

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    data = text_corpus()
    split = data.numel() * 9 // 10
    train_data, eval_data = data[:split], data[split:]
    preset = PRESETS[TEXT_MODELS[model_name]]
    rows = recipe.get("rows", 8)
    options = {"codegen": "eager", **SETTINGS[setting]}
    unsharded = build_model(preset, seed=seed, device="cpu")
    if options.pop("_one_ulp", False):
        with torch.no_grad():
            for p in unsharded.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
    model = z3.shard(unsharded)
    step_model = torch.compile(model, backend="zero3", options=options)
    gen = torch.Generator().manual_seed(seed)
    report = None
    if world > 1:
        x, _ = text_batch(train_data, rows, torch.Generator().manual_seed(99))
        report = z3.explain(step_model, x).to_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, steps, recipe["schedule"])
    )
    losses, times = [], []
    for _ in range(steps):
        inputs, targets = text_batch(train_data, world * rows, gen)  # the same on every rank
        mine = slice(rank * rows, (rank + 1) * rows)
        start = time.perf_counter()
        loss = lm_loss(step_model, (inputs[mine], targets[mine]))
        loss.backward()
        if recipe.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["clip"])
        opt.step()
        opt.zero_grad()
        schedule.step()
        times.append(time.perf_counter() - start)
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    eval_gen = torch.Generator().manual_seed(12345)
    eval_losses = []
    with torch.no_grad():
        for _ in range(recipe["eval_batches"]):
            eval_losses.append(lm_loss(step_model, text_batch(eval_data, rows, eval_gen)).item())
    eval_loss = torch.tensor(statistics.fmean(eval_losses))
    if world > 1:
        dist.all_reduce(eval_loss)
    out = {
        "losses": losses,
        "eval_loss": eval_loss.item() / world,
        "step_s": statistics.median(times[min(5, steps - 1) :]),
    }
    if report is not None:
        wire, full, groups = {}, {}, {}
        for graph in report["graphs"]:
            for kind, stats in graph["collectives"].items():
                wire[kind] = wire.get(kind, 0) + stats["bytes"]
                full[kind] = full.get(kind, 0) + stats.get("full_bytes", stats["bytes"])
            for role, kinds in graph["group_bytes"].items():
                groups[role] = groups.get(role, 0) + sum(kinds.values())
        out["wire_bytes"], out["full_bytes"], out["group_bytes"] = wire, full, groups
    return out


def _job(
    rank: int,
    world: int,
    model_name: str,
    setting: str,
    steps: int,
    recipe: dict,
    per_node: int,
    seed: int = 0,
) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return train(rank, world, model_name, setting, steps, recipe, seed)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's (peak) learning rate")
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches per rank")
    parser.add_argument("--rows", type=int, default=8, help="sequences per rank and step")
    parser.add_argument(
        "--clip", type=float, default=0.0, help="max global gradient 2-norm (0: no clipping)"
    )
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--settings", default=None, help="default: every one that applies")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs of the uncompressed setting with seeds 1.. (initialisation and batches) "
        "beside seed 0: the spread of the held-out loss the settings' differences compare to",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="run every setting from every seed (not only the uncompressed one) and report each "
        "setting's held-out loss against the uncompressed run of the same seed",
    )
    parser.add_argument("--tag", default="", help="suffix of the results file's name")
    parser.add_argument("--out", default=results_dir(), help="folder of the results JSON and logs")
    args = parser.parse_args()
    recipe = {
        "lr": args.lr,
        "schedule": args.schedule,
        "eval_batches": args.eval_batches,
        "rows": args.rows,
        "clip": args.clip,
    }
    per_node = args.ranks_per_node
    if args.world % per_node:
        parser.error("--ranks-per-node must divide --world")
    hpz = 2 <= per_node < args.world
    settings = args.settings.split(",") if args.settings else [
        s for s in SETTINGS if hpz or "secondary_shard" not in SETTINGS[s]
    ]  # fmt: skip
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(
            f"unknown settings {unknown}; --settings is a comma-separated list of {list(SETTINGS)}"
        )
    log_dir = os.path.join(args.out, "compression")
    results: dict = {
        "world": args.world,
        "ranks_per_node": per_node,
        "steps": args.steps,
        "recipe": recipe,
        "models": {},
    }
    for model_name in args.models.split(","):
        runs = {}
        compute = run_ranks(
            _job,
            1,
            (model_name, "none", min(args.steps, 40), recipe, 1),
            log_dir=log_dir,
            name=f"{model_name}-compute",
            timeout_s=1800,
        )[0]["step_s"]
        for setting in settings:
            per_rank = run_ranks(
                _job,
                args.world,
                (model_name, setting, args.steps, recipe, per_node),
                log_dir=log_dir,
                name=f"{model_name}-{setting}",
                timeout_s=3600,
            )
            runs[setting] = per_rank[0]
            print(f"{model_name} {setting}: eval {per_rank[0]['eval_loss']:.4f}", flush=True)
        for seed in range(1, args.seeds):
            for setting in settings if args.paired else ["none"]:
                per_rank = run_ranks(
                    _job,
                    args.world,
                    (model_name, setting, args.steps, recipe, per_node, seed),
                    log_dir=log_dir,
                    name=f"{model_name}-{setting}-seed{seed}",
                    timeout_s=3600,
                )
                runs[f"{setting}, seed {seed}"] = per_rank[0]
                print(
                    f"{model_name} {setting} seed {seed}: eval {per_rank[0]['eval_loss']:.4f}",
                    flush=True,
                )
        results["models"][model_name] = {"compute_s": compute, "runs": runs}
    _print(results)
    folder = args.out
    os.makedirs(folder, exist_ok=True)
    suffix = f"-{per_node}per-node" if per_node > 1 else ""
    suffix += f"-{args.tag}" if args.tag else ""
    path = os.path.join(folder, f"compression-{args.world}{suffix}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


def _print(results: dict) -> None:
    world, per_node = results["world"], results.get("ranks_per_node", 1)
    print(
        f"\n{world} ranks, nodes of {per_node}\n\n| model | setting | eval loss (vs none) | loss at "
        f"step {results['steps']} | gather MiB/step | reduce MiB/step | inter-node MiB/step | "
        "intra-node MiB/step | step here | modelled 100 Gbps | modelled 400 Gbps |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model_name, entry in results["models"].items():
        base = entry["runs"].get("none")
        compute = entry["compute_s"]
        for setting, run in entry["runs"].items():
            wire, full, groups = run["wire_bytes"], run["full_bytes"], run["group_bytes"]
            gather = wire.get("all_gather", 0)
            reduce = wire.get("reduce_scatter", 0)
            intra = groups.get(NODE_ROLE, 0)
            across = groups.get(ACROSS_ROLE, 0)
            inter = sum(v for role, v in groups.items() if role != NODE_ROLE)
            # ring over G ranks: (G-1)/G of the bytes per rank (the shard group spans the world,
            # the across-nodes group one rank per node; hybrid meshes are not benchmarked here)
            nodes = world // per_node
            inter_sent = (world - 1) / world * (inter - across) + (nodes - 1) / nodes * across
            intra_sent = (per_node - 1) / per_node * intra if per_node > 1 else 0
            cells = []
            for gbps in (100, 400):
                comm = inter_sent * 8 / (gbps * 1e9) + intra_sent * 8 / (INTRA_GBPS * 1e9)
                cells.append(f"{max(compute, comm) * 1e3:.1f}-{(compute + comm) * 1e3:.1f} ms")
            delta = (
                ""
                if base is None
                else f" ({(run['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}%)"
            )
            print(
                f"| {model_name} | {setting} | {run['eval_loss']:.4f}{delta} | "
                f"{run['losses'][-1]:.4f} | {gather / 2**20:.3f} ({full.get('all_gather', 0) / 2**20:.3f}) | "
                f"{reduce / 2**20:.3f} ({full.get('reduce_scatter', 0) / 2**20:.3f}) | "
                f"{inter / 2**20:.3f} | {intra / 2**20:.3f} | "
                f"{run['step_s'] * 1e3:.1f} ms | {cells[0]} | {cells[1]} |"
            )
    _print_paired(results)


CURVE_WINDOW = 50  # steps per mean of the training loss when curves are compared


def curve_gap(losses: list[float], base: list[float], window: int = CURVE_WINDOW) -> float:
    """The largest relative difference (%) between two loss curves' means over consecutive
    windows of ``window`` steps (single steps are one batch's noise)."""
    gaps = [
        statistics.fmean(losses[i : i + window]) / statistics.fmean(base[i : i + window]) - 1
        for i in range(0, min(len(losses), len(base)) - window + 1, window)
    ]
    return max(gaps, key=abs) * 100


def _print_paired(results: dict) -> None:
    """Each setting's held-out loss against the uncompressed run of the same seed (``--paired``):
    the difference compression makes, apart from what the seed makes; and the training curves'
    largest gap (means over ``CURVE_WINDOW`` steps)."""
    rows = []
    for model_name, entry in results["models"].items():
        runs = entry["runs"]
        seeds = sorted({0} | {int(k.rsplit(" ", 1)[1]) for k in runs if ", seed " in k})
        for setting in [k for k in runs if ", seed " not in k and k != "none"]:
            diffs, gaps = [], []
            for seed in seeds:
                key = setting if seed == 0 else f"{setting}, seed {seed}"
                base = "none" if seed == 0 else f"none, seed {seed}"
                if key in runs and base in runs:
                    diffs.append((runs[key]["eval_loss"] / runs[base]["eval_loss"] - 1) * 100)
                    gaps.append(curve_gap(runs[key]["losses"], runs[base]["losses"]))
            if len(diffs) > 1:
                rows.append((model_name, setting, diffs, gaps))
    if not rows:
        return
    print(
        "\nheld-out loss against the uncompressed run of the same seed; the training curve's "
        f"largest gap ({CURVE_WINDOW}-step means)\n\n"
        "| model | setting | per seed | mean | largest | curve gap per seed |\n"
        "|---|---|---|---:|---:|---|"
    )
    for model_name, setting, diffs, gaps in rows:
        cells = ", ".join(f"{d:+.2f}%" for d in diffs)
        largest = max(diffs, key=abs)
        curve = ", ".join(f"{g:+.2f}%" for g in gaps)
        print(
            f"| {model_name} | {setting} | {cells} | {statistics.fmean(diffs):+.2f}% | "
            f"{largest:+.2f}% | {curve} |"
        )


if __name__ == "__main__":
    main()
