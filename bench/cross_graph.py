"""Per-block compile against the whole-model compile, steady steps, side by side in one process.

    python -m bench.cross_graph --depth 12,24 --steps 40

For each depth: four copies of the same GPT (``--model``, default ``gpt-w128`` at that many
blocks), sharded over 2 gloo ranks, eager codegen: ``torch.compile(model, backend="zero3")``
(whole), ``block.compile(backend="zero3")`` for every block (per block, the rest eager), per
block with ``cross_graph_prefetch`` (each block's first all-gather issued in the previous block's
tail, ``collectives/handoff.py``), and per block with the parameters outside the blocks gathered
and reduced one by one (the model's root unit, ``frontend/root_unit.py``, taken off: what
per-block compile did before it). The four train in turn, one step each, so they see the same
machine; the table gives the median step over ``--steps`` after 3 warm-up steps, the ratio to
the whole model, the prefetches taken over, and each setup's cross-rank checks per step (one
per graph run and per eager collective) with their time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.harness.launch import run_ranks
from bench.harness.models import PRESETS, build_model, lm_loss, transformer_blocks
from bench.harness.paths import results_dir

SETUPS = (
    "whole",
    "per block",
    "per block + cross_graph_prefetch",
    "per block, parameters outside gathered one by one",
)
WARMUP = 3


def _setup(model, how: str):
    import zero3_compile as z3

    z3.shard(model)
    options = {"codegen": "eager", "cross_graph_prefetch": how == SETUPS[2]}
    if how == SETUPS[0]:
        return torch.compile(model, backend="zero3", options=options)
    for block in transformer_blocks(model):
        block.compile(backend="zero3", options=options)
    if how == SETUPS[3]:  # as before the root unit: its hooks taken off this model
        from zero3_compile.frontend import root_unit

        for hooks in (model._forward_pre_hooks, model._forward_hooks):
            for key in [k for k, h in hooks.items() if type(h).__module__ == root_unit.__name__]:
                del hooks[key]
    return model


def _job(rank: int, world: int, preset_name: str, depth: int, steps: int) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return _measure(preset_name, depth, steps)
    finally:
        dist.destroy_process_group()


def _measure(preset_name: str, depth: int, steps: int) -> dict:
    from zero3_compile.collectives.handoff import HANDOFF
    from zero3_compile.runtime import guard, root

    preset = PRESETS[preset_name]
    preset = dataclasses.replace(preset, config=dataclasses.replace(preset.config, n_layer=depth))
    runs = {}
    for how in SETUPS:
        model = build_model(preset, seed=0, device="cpu")
        runs[how] = (_setup(model, how), torch.optim.AdamW(model.parameters(), lr=1e-3))
    checks = {how: [0, 0.0] for how in SETUPS}
    current = [SETUPS[0]]
    check = guard.run_check

    def counted(*args, **kwargs):
        start = time.perf_counter()
        try:
            return check(*args, **kwargs)
        finally:
            entry = checks[current[0]]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    guard.run_check = root.run_check = counted
    gen = torch.Generator().manual_seed(0)
    seq, rows = preset.seq_len, preset.per_rank_batch
    times = {how: [] for how in SETUPS}
    taken = {how: 0 for how in SETUPS}
    losses = {how: [] for how in SETUPS}
    for step in range(WARMUP + steps):
        tokens = torch.randint(0, preset.config.vocab_size, (rows, seq + 1), generator=gen)
        batch = (tokens[:, :-1], tokens[:, 1:])
        if step == WARMUP:
            for entry in checks.values():
                entry[0], entry[1] = 0, 0.0
        for how in SETUPS:
            step_model, opt = runs[how]
            current[0] = how
            before = HANDOFF.taken
            dist.barrier()
            start = time.perf_counter()
            loss = lm_loss(step_model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
            if step >= WARMUP:
                times[how].append(elapsed)
                taken[how] += HANDOFF.taken - before
            losses[how].append(loss.item())
    return {
        how: {
            "step_s": statistics.median(times[how]),
            "taken_per_step": taken[how] / steps,
            "checks_per_step": checks[how][0] / steps,
            "check_ms_per_step": checks[how][1] / steps * 1e3,
            "last_loss": losses[how][-1],
        }
        for how in SETUPS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", default="12,24")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="gpt-w128")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    log_dir = results_dir("cross_graph")
    print(
        f"{args.world} gloo ranks, {args.model}, eager codegen, median of {args.steps} steps\n\n"
        "| blocks | setup | step | vs whole | prefetches taken over per step | "
        "cross-rank checks per step (ms) | last loss |\n|---:|---|---:|---:|---:|---:|---:|"
    )
    for depth in (int(d) for d in args.depth.split(",")):
        result = run_ranks(
            _job,
            args.world,
            (args.model, depth, args.steps),
            log_dir=log_dir,
            name=f"depth{depth}",
            timeout_s=3600,
        )[0]
        whole = result[SETUPS[0]]["step_s"]
        for how in SETUPS:
            r = result[how]
            print(
                f"| {depth} | {how} | {r['step_s'] * 1e3:.1f} ms | {r['step_s'] / whole:.2f}x | "
                f"{r['taken_per_step']:.0f} | {r['checks_per_step']:.0f} "
                f"({r['check_ms_per_step']:.1f}) | {r['last_loss']:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
