"""What each rank of one contender runs: build, train, time, profile one step, report.

Steps 0 .. warmup-1 are warm-up (step 0 includes compilation), the next ``steps`` are timed, and
one more step runs under ``torch.profiler`` for the memory peak and the collectives. Every step's
loss is kept: all contenders run the same number of steps on the same batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from . import comm
from .contenders import CONTENDERS, Context, Trainer
from .memory import StepMemoryProbe, rss_high_water_bytes, storage_bytes
from .models import PRESETS, build_model, global_batch, parameter_count, rank_slice
from .proc import reset_rss_high_water


@dataclass(frozen=True)
class RunSpec:
    contender: str
    preset: str
    world: int  # data-parallel world size (the global batch is world * per-rank batch)
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo", "nccl" or "fake" (one process standing for rank 0 of ``world``)
    warmup: int
    steps: int
    seed: int
    threads: int
    zero3_options: str = "{}"  # JSON: extra options of the zero3 contenders (e.g. bucket_mb)
    # read zero3's communication from its compiled graphs (recording them compiles every graph
    # instead of loading it from the caches: off for warm-start compile times)
    record_graphs: bool = True
    n_layer: int | None = None  # the preset's depth, or this many blocks (compile_time.py --depth)


def _device(spec: RunSpec, rank: int) -> torch.device:
    if spec.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def run_contender(rank: int, processes: int, spec: RunSpec) -> dict[str, Any]:
    """Entry point of one rank (``processes`` is 1 for ``single`` and for the fake group)."""
    torch.set_num_threads(spec.threads)
    contender = CONTENDERS[spec.contender]
    preset = PRESETS[spec.preset]
    if spec.n_layer is not None:
        preset = dataclasses.replace(
            preset, config=dataclasses.replace(preset.config, n_layer=spec.n_layer)
        )
    device = _device(spec, rank)
    world = spec.world if contender.distributed else 1
    ctx = Context(
        rank,
        world,
        device,
        spec.backend,
        preset.per_rank_batch,
        zero3_options=json.loads(spec.zero3_options),
    )
    contender.init_process_group(ctx)
    model = build_model(preset, spec.seed, device)
    info = {"n_params": parameter_count(model), "param_bytes": storage_bytes(model.parameters())}

    records_cm: Any = contextlib.nullcontext(None)
    if contender.comm_source == "graphs" and spec.record_graphs:
        from zero3_compile.compiler.recording import record_graphs

        records_cm = record_graphs()
    # torch.compile(backend="inductor") imports Inductor when it is called, a custom backend at
    # its first graph: import it up front for everyone, so no contender's first step pays it
    importlib.import_module("torch._inductor.compile_fx")

    with records_cm as records:
        start = time.perf_counter()
        trainer = contender.setup(model, ctx)
        info["setup_s"] = time.perf_counter() - start
        result = _train(trainer, spec, ctx, rank if contender.distributed else None)
    if records is not None:
        result["comm_graphs"] = comm.summarize(comm.from_graphs(records), world)
        # memory_budget_mb: the planner's plan of each forward graph
        result["budget_plans"] = [r.budget.to_dict() for r in records if r.budget is not None]
        result["n_graphs"] = {k: sum(r.kind == k for r in records) for k in ("forward", "backward")}
    if spec.contender.startswith("zero3"):
        from zero3_compile.compiler.recording import compile_stats

        result["zero3_compile_s"] = compile_stats()
    return {**info, **result, "rank": rank, "torch": torch.__version__, "threads": spec.threads}


def _train(trainer: Trainer, spec: RunSpec, ctx: Context, data_rank: int | None) -> dict:
    preset = PRESETS[spec.preset]
    real_group = data_rank is not None and ctx.backend != "fake"

    def batch(step: int):
        full = global_batch(preset, spec.world, step, spec.seed)
        if data_rank is not None:
            full = rank_slice(full, data_rank, preset.per_rank_batch)
        return full[0].to(ctx.device), full[1].to(ctx.device)

    def sync() -> None:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if real_group:
            dist.barrier()  # every rank starts the step together: no rank times another's lag

    times, losses = [], []
    rss_warmup, hwm_was_reset = None, False
    for step in range(spec.warmup + spec.steps):
        inputs = batch(step)
        sync()
        start = time.perf_counter()
        loss = trainer.forward_backward(inputs)
        trainer.optimizer_step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step == spec.warmup - 1:
            rss_warmup = rss_high_water_bytes()  # includes compilation
            hwm_was_reset = reset_rss_high_water()
    rss_steady = rss_high_water_bytes() if hwm_was_reset else None

    probe = StepMemoryProbe(ctx.device, trainer.held_in_cpp_bytes())
    inputs = batch(spec.warmup + spec.steps)
    probe.start()  # before the barrier: its gc scan takes a different time on each rank
    sync()
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,  # the collectives' tensor sizes
        profile_memory=ctx.device.type == "cpu",
    ) as prof:
        loss = trainer.forward_backward(inputs)
        state = trainer.state_bytes()
        trainer.optimizer_step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
    losses.append(loss.item())
    return {
        "times_s": times,
        "losses": losses,
        "state": state,
        "memory": probe.finish(prof),
        "rss_hwm_warmup": rss_warmup,
        "rss_hwm_steady": rss_steady,
        "comm_profile": comm.summarize(comm.from_profile(prof), ctx.world),
    }
