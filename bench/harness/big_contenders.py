"""big_model.py's contenders, one function per system run on each rank (``run_ranks``): zero3
with its state on disk (and its checkpoint's save, resume and kill checks), the same step in
memory for the compute-alone measure, FSDP2, and DeepSpeed ZeRO-3 / ZeRO-Infinity; each loads a
Hugging Face Llama checkpoint and trains phase by phase (``Phases``).

Example:
    per_rank = run_ranks(CONTENDERS["zero3"], 2, (cfg,), log_dir=logs, name="zero3")
    per_rank[0]["phases"]["steps"]["seconds"]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from .disk import IoTrace, offload_stores
from .launch import set_rank_threads
from .llama import token_batch
from .phases import Phases


def _unmeasured(name: str, settle: bool = True):
    return contextlib.nullcontext()


def _train_phases(phases: Phases, step_model, opt, rank: int, cfg: dict, backward=None):
    """The first step (it compiles) and the others as two phases; returns the step function
    and the losses list it appends to. ``backward(loss)``: instead of ``loss.backward()``
    (DeepSpeed's engine)."""
    losses = []

    def step(
        i,
        phase=_unmeasured,
        names=("first step: forward (compiles)", "first step: backward", "first step: optimizer"),
    ):
        ids = token_batch(i, rank, cfg["seq"], cfg["vocab"])
        with phase(names[0]):
            loss = step_model(input_ids=ids, labels=ids).loss
        with phase(names[1], settle=False):
            if backward is None:
                loss.backward()
            else:
                backward(loss)
        with phase(names[2], settle=False):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    # the first step in three phases: which of them sets its peak
    step(0, phases.phase)
    with phases.phase("steps"):
        for i in range(1, cfg["steps"]):
            # where the steady step's time goes, summed over the steps (reported after "steps")
            step(
                i,
                lambda name, settle=True: phases.part(name),
                ("steps: forward", "steps: backward", "steps: optimizer"),
            )
    return step, losses


def shard_digest(model) -> str:
    """sha256 of every shard of a zero3 model, offloaded ones read back (equal across runs and
    code versions that hold the same values)."""
    import zero3_compile as z3  # noqa: F401

    sha = hashlib.sha256()
    for name, state in model.sharded_parameters():
        from zero3_compile.offload.params import loaded

        with loaded([state] if state.offload is not None else [], write_back=False):
            sha.update(name.encode())
            # a copy: a numpy view would pin the storage, which eviction then cannot free
            sha.update(state.local().detach().clone().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def offload_of(z3, cfg: dict, scratch: str):
    """The ``z3.Offload`` of a run's ``cfg`` (None without ``offload="disk"``)."""
    if cfg["offload"] != "disk":
        return None
    grads = "disk" if cfg["grads"] == "disk" else None
    return z3.Offload(
        params="disk",
        grads=grads,
        path=scratch,
        double_buffer=not cfg["single_copy"],
        o_direct=cfg.get("o_direct", False),
        threads=cfg.get("io_threads", 4),
    )


def _optimizer(z3, model, cfg: dict, scratch: str, in_backward: bool):
    """AdamW(lr=1e-4), with ``offload="disk"`` wrapped by ``z3.offload_optimizer`` as ``cfg``
    says (a resumed run steps after the backward: ``in_backward=False``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg.get("fused_adamw", False))
    if cfg["offload"] != "disk":
        return opt
    return z3.offload_optimizer(
        opt,
        tier="disk",
        path=scratch,
        double_buffer=not cfg["single_copy"],
        tile_mb=cfg.get("tile_mb", 64.0),
        o_direct=cfg.get("o_direct", False),
        in_backward=in_backward,
        threads=cfg.get("io_threads", 4),
    )


def run_zero3(rank, world, cfg: dict):
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    set_rank_threads(world)
    if cfg.get("switch_interval"):
        sys.setswitchinterval(cfg["switch_interval"])
    dist.init_process_group("gloo")
    phases = Phases(cfg["scratch"])
    if cfg.get("io_trace"):
        phases.trace = IoTrace()
    scratch = os.path.join(cfg["scratch"], f"run-{cfg['tag']}")
    offload = offload_of(z3, cfg, scratch)
    policy = z3.MixedPrecision(torch.bfloat16, torch.float32) if cfg["bf16"] else None
    with phases.phase("load"):
        model = z3hf.from_pretrained(
            transformers.AutoModelForCausalLM,
            cfg["checkpoint"],
            dtype=torch.float32,
            offload=offload,
            mp_policy=policy,
        )
        model.train()
    phases.model = model
    opt = _optimizer(z3, model, cfg, scratch, in_backward=cfg.get("in_backward", False))
    phases.opt = opt
    if cfg.get("compile_once"):
        z3.compile_once(model.model.layers)
    step_model = torch.compile(model, backend="zero3", options=_options(cfg))
    step, losses = _train_phases(phases, step_model, opt, rank, cfg)
    steps = cfg["steps"]
    result = {"phases": phases.records, "losses": losses, "steps": steps}
    in_backward = getattr(getattr(opt, "_zero3_offload", None), "in_backward", None)
    if in_backward is not None:  # over all steps: where the stepping thread's time went
        result["in_backward"] = {
            "waited_s": in_backward.waited_s,
            "stepper_waited_s": in_backward.stepper_waited_s,
            "reused_gb": in_backward.reused_bytes / 1e9,
        }
    from zero3_compile.offload import host_cache

    if host_cache.installed():
        result["host_cache"] = host_cache.stats()
    if cfg["checkpoint"] and cfg.get("save"):
        path = os.path.join(cfg["scratch"], "checkpoint")
        with phases.phase("checkpoint save"):
            z3.save_checkpoint(path, model, opt, rank_state={"step": steps})
        sizes = sum(
            os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
        )  # fmt: skip
        result["checkpoint_bytes"] = sizes
        step(steps)  # the step a resumed run must reproduce
        result["after_save_loss"] = losses[-1]
        result["after_save_digest"] = shard_digest(model)
        if cfg.get("kill"):
            _killed_mid_step(rank, cfg, result, step, steps + 1)
    dist.barrier()
    if phases.trace is not None:  # last: the replay overwrites the stores' values
        result["io_trace"] = phases.trace.summary()
        phases.trace.save(os.path.join(cfg["out"], f"io-trace-{cfg['tag']}-rank{rank}.json"))
        dist.barrier()
        # the last step's transfers as traced, then as sequential as they can be, twice each in
        # turn (the disk's rate drifts by the minute): the step's pattern against its bytes
        stores, events = offload_stores(model, opt), phases.trace.last_step()
        result["io_trace"]["replays"] = []
        for order in ("traced", "sorted", "traced", "sorted"):
            dist.barrier()
            result["io_trace"]["replays"].append(phases.trace.replay(stores, events, order))
        dist.barrier()
    return result


def kill_result(cfg: dict, rank: int) -> str:
    """Where a ``--kill`` run's rank leaves its result before rank 1 is killed."""
    return os.path.join(cfg["out"], f"killed-{cfg['tag']}-rank{rank}.json")


def _killed_mid_step(rank: int, cfg: dict, result: dict, step, index: int) -> None:
    """``--kill``: this rank's result goes to a file, then rank 1 is SIGKILLed halfway into one
    more step (its collectives, offload reads and writes in flight) and rank 0 fails in it or
    at the barrier after it; never returns."""
    with open(kill_result(cfg, rank), "w") as f:
        json.dump(result, f, default=str)
    dist.barrier()
    if rank == 1:
        seconds = result["phases"]["steps"]["seconds"] / max(1, cfg["steps"] - 1)
        threading.Timer(seconds / 2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    step(index)
    if rank == 1:  # the step ran faster than half a step: killed after it instead
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0: fails here at the latest (its peer is gone)
    raise RuntimeError("zero3: rank 1 was to be killed, but the ranks finished the step")


def left_behind(scratch: str) -> list[str]:
    """Files under the offload folder outside the checkpoint (a store unlinks its files once
    opened, so a killed run must leave none)."""
    found = []
    for folder, subfolders, files in os.walk(scratch):
        subfolders[:] = [d for d in subfolders if d != "checkpoint"]
        found += [os.path.join(folder, name) for name in files]
    return found


def run_resume(rank, world, cfg: dict):
    """New processes: load the sealed checkpoint, take the next step, digest the shards."""
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    set_rank_threads(world)
    dist.init_process_group("gloo")
    phases = Phases(cfg["scratch"])
    scratch = os.path.join(cfg["scratch"], "run-resume")
    offload = offload_of(z3, cfg, scratch)
    policy = z3.MixedPrecision(torch.bfloat16, torch.float32) if cfg["bf16"] else None
    model = z3hf.from_pretrained(
        transformers.AutoModelForCausalLM, cfg["checkpoint_model"], dtype=torch.float32,
        offload=offload, mp_policy=policy,
    )  # fmt: skip
    model.train()
    opt = _optimizer(z3, model, cfg, scratch, in_backward=False)
    phases.model, phases.opt = model, opt
    path = os.path.join(cfg["scratch"], "checkpoint")
    with phases.phase("checkpoint load"):
        state = z3.load_checkpoint(path, model, opt)
    step_model = torch.compile(model, backend="zero3", options=_options(cfg))
    ids = token_batch(state["step"], rank, cfg["seq"], cfg["vocab"])
    loss = step_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return {"phases": phases.records, "loss": loss.item(), "digest": shard_digest(model)}


def _options(cfg: dict) -> dict:
    """The zero3 compile options of a run: its codegen and ``--zero3-options``."""
    return {"codegen": cfg["codegen"], **cfg.get("zero3_options", {})}


def run_compute(rank, world, cfg: dict):
    """The step without I/O: the same width at ``layers`` depth, in memory."""
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    set_rank_threads(world)
    dist.init_process_group("gloo")
    policy = z3.MixedPrecision(torch.bfloat16, torch.float32) if cfg["bf16"] else None
    model = z3hf.from_pretrained(
        transformers.AutoModelForCausalLM, cfg["checkpoint"], dtype=torch.float32,
        mp_policy=policy,
    )  # fmt: skip
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg.get("fused_adamw", False))
    step_model = torch.compile(model, backend="zero3", options=_options(cfg))
    times = []
    for i in range(5):  # the median of 4 steps: the extrapolation multiplies their noise
        ids = token_batch(i, rank, cfg["seq"], cfg["vocab"])
        start = time.perf_counter()
        step_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:])}


def run_fsdp2(rank, world, cfg: dict):
    import transformers
    from torch.distributed.fsdp import fully_shard

    set_rank_threads(world)
    dist.init_process_group("gloo")
    phases = Phases(cfg["scratch"])
    with phases.phase("load"):
        # FSDP2 through transformers: meta init, shard, each rank loads every tensor and keeps
        # its part (the usual recipe: from_pretrained on every rank, then fully_shard)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            cfg["checkpoint"], dtype=torch.float32
        )
        policy = {}
        if cfg["bf16"]:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
        for layer in model.model.layers:
            fully_shard(layer, **policy)
        fully_shard(model, **policy)
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _, losses = _train_phases(phases, model, opt, rank, cfg)
    return {"phases": phases.records, "losses": losses, "steps": cfg["steps"]}


class _EngineStep:
    """DeepSpeed's engine as the optimizer ``_train_phases`` calls: ``engine.step()`` steps and
    clears the gradients."""

    def __init__(self, engine):
        self.engine = engine

    def step(self):
        self.engine.step()

    def zero_grad(self, set_to_none=True):
        pass


def run_deepspeed(rank, world, cfg: dict):
    """DeepSpeed ZeRO-3 as its users load a Hugging Face model: ``HfDeepSpeedConfig`` alive
    before ``from_pretrained`` (parameters partitioned as they are created, under
    ``deepspeed.zero.Init``), then ``deepspeed.initialize``; AdamW as torch's
    (``torch_adam``). With ``--offload disk``: ZeRO-Infinity, parameters and optimizer state on
    NVMe through its ``async_io`` op (``infinity_config``); ``--ds-config`` overrides any key."""
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    set_rank_threads(world)
    deepspeed.init_distributed(dist_backend="gloo")
    from .contenders import Context, OptimConfig, deepspeed_config

    # torch.optim.AdamW(lr=1e-4) with its defaults: what the other contenders step with
    adamw = OptimConfig(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    config = deepspeed_config(Context(rank, world, torch.device("cpu"), "gloo", 1, adamw))
    if cfg["bf16"]:
        config["bf16"] = {"enabled": True}
    if cfg["offload"] == "disk":
        nvme = os.path.join(cfg["scratch"], f"run-{cfg['tag']}-nvme-rank{rank}")
        os.makedirs(nvme, exist_ok=True)
        # its swap buffers must hold the largest parameter's partition (the embedding's)
        largest = -(-cfg["vocab"] * cfg["hidden"] // world)
        _merge(config, infinity_config(nvme, largest))
    _merge(config, json.loads(cfg.get("ds_config") or "{}"))
    if rank == 0:
        print("[deepspeed] config", json.dumps(config), flush=True)
    phases = Phases(cfg["scratch"])
    with phases.phase("load"):
        keep = HfDeepSpeedConfig(config)  # noqa: F841  (from_pretrained reads it while alive)
        # with its bf16 section, as its users load: bf16 parameters (its optimizer keeps the
        # fp32 master copy); loaded in fp32, its parameter swap buffers are fp32 too (8 x 197M
        # elements locked per rank at 3B: OOM-killed while loading)
        dtype = torch.bfloat16 if cfg["bf16"] else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg["checkpoint"], dtype=dtype)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        engine.train()
    _, losses = _train_phases(
        phases, engine, _EngineStep(engine), rank, cfg, backward=engine.backward
    )
    return {"phases": phases.records, "losses": losses, "steps": cfg["steps"]}


def infinity_config(nvme_path: str, largest_partition: int) -> dict:
    """ZeRO-Infinity (parameters and optimizer state on NVMe through ``async_io``) in the first
    configuration found that trains here (the search: bench/RESULTS.md). From the documentation's
    NVMe example: no pinned memory (a CPU accelerator; the parameter swapper locks its buffers
    anyway), swap buffers as large as the largest parameter's partition (the default 1e8 elements
    fails an assertion on a 128256-row embedding) and 8 of them (each is locked in memory: at the
    1.5B width in fp32, 32 were OOM-killed while loading, 7 or 8 in the backward; 6 ran out),
    ``stage3_max_reuse_distance`` 0 (else the second step fails "Not enough buffers 0 for
    swapping 1": parameters kept for reuse hold swap buffers; DeepSpeed issue #3062), nothing
    kept in memory (``max_in_cpu`` 0), no prefetch, and sub-groups and buckets of 1e7 elements
    (their buffers are in memory too).
    ``--ds-config`` changes any of it."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme", "nvme_path": nvme_path, "pin_memory": False,
                "buffer_count": 8, "buffer_size": max(int(1e8), largest_partition),
                "max_in_cpu": 0,
            },
            "offload_optimizer": {
                "device": "nvme", "nvme_path": nvme_path, "pin_memory": False,
                "buffer_count": 4, "fast_init": False,
            },
            "sub_group_size": int(1e7),
            "reduce_bucket_size": int(1e7),
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": int(1e8),
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": int(1e5),
        },
        "aio": {
            "block_size": 1 << 20, "queue_depth": 8, "thread_count": 1,
            "single_submit": False, "overlap_events": True,
        },
        # its CPU Adam needs a pinned-memory accelerator path; torch's AdamW steps the same update
        "zero_force_ds_cpu_optimizer": False,
    }  # fmt: skip


def _merge(into: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


CONTENDERS = {"zero3": run_zero3, "fsdp2": run_fsdp2, "deepspeed": run_deepspeed}
