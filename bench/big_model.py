"""Models larger than the machine: a Llama loaded from a Hugging Face checkpoint into shards,
trained with parameters and optimizer state on disk, phase by phase.

    python bench/big_model.py --model llama-1b --world 2 --offload disk --steps 3
    python bench/big_model.py --model llama-1.5b --world 2 --offload disk --steps 3 --checkpoint
    python bench/big_model.py --model llama-3b --world 2 --offload disk --steps 3
    python bench/big_model.py --model llama-1b --contenders zero3,fsdp2,deepspeed --offload none

Run it alone on the machine. The checkpoint (bf16 safetensors, Hugging Face layout) is written
once under ``--cache``, tensor by tensor, never holding the model; each contender then runs in
fresh processes. Per phase and rank: wall time, the peak resident memory (``VmHWM``, reset at the
start of each phase), bytes read and written (the offload stores' counters and the process's
``/proc/self/io``), the I/O time the step waited for (exposed) against the store threads' total.
Beside them, the physical limit: the disk's sequential bandwidth measured here with ``O_DIRECT``
(16 MiB blocks, the best of 1, 2 and 4 streams), the step's compute time without I/O (the same
model without offload, at ``--compute-layers`` depths, alternated ``--compute-repeats`` times, a
line fitted and extrapolated to the full depth), and the bound max(compute, bytes moved /
bandwidth). ``--checkpoint`` saves a sealed checkpoint after the first steps, resumes it in new
processes and checks the resumed step is bit-identical; with ``--kill`` rank 1 is SIGKILLed
halfway into a step after the save, the offload folder is checked for files left behind, and the
resume starts from the checkpoint alone.
``--io-trace`` records the stores' transfers in the steady steps and replays the last step's on
the same files after the run (as traced, and sorted by offset): the disk's time for the step's
own bytes and pattern, measured beside the step.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import json
import mmap
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from bench.harness.launch import RankError, run_ranks
from bench.harness.paths import results_dir
from bench.offload import _stores

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    tied: bool = True


SHAPES = {
    "llama-125m": Shape(12, 768, 3072, 12, 4, vocab=32000),
    "llama-1b": Shape(16, 2048, 8192, 32, 8),  # Llama-3.2-1B
    "llama-1.3b": Shape(16, 2048, 8192, 32, 8, tied=False),
    "llama-1.5b": Shape(20, 2048, 8192, 32, 8),
    "llama-3b": Shape(28, 3072, 8192, 24, 8),  # Llama-3.2-3B
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--offload", choices=["disk", "none"], default="disk")
    parser.add_argument(
        "--grads", choices=["disk", "memory"], default="disk",
        help="with --offload disk: gradient shards on disk too (Offload(grads='disk'))",
    )  # fmt: skip
    parser.add_argument(
        "--single-copy", action="store_true",
        help="one copy of the offloaded state on disk (double_buffer=False): half the disk",
    )  # fmt: skip
    parser.add_argument(
        "--o-direct", action="store_true",
        help="offload stores opened with O_DIRECT (Offload(o_direct=True), offload_optimizer's)",
    )  # fmt: skip
    parser.add_argument(
        "--io-threads", type=int, default=4,
        help="I/O threads of each offload store (Offload(threads=...), offload_optimizer's)",
    )  # fmt: skip
    parser.add_argument(
        "--in-backward", action="store_true",
        help="offload_optimizer(in_backward=True): each parameter steps during the backward",
    )  # fmt: skip
    parser.add_argument(
        "--fused-adamw", action="store_true",
        help="AdamW(fused=True): one kernel per tensor (zero3 and its compute-alone measure)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--layers", type=int, default=0, help="probe: the model's width at this depth"
    )
    parser.add_argument(
        "--tile-mb",
        type=float,
        default=64.0,
        help="offload_optimizer's tile (a parameter larger than it steps in pieces)",
    )
    parser.add_argument("--seq", type=int, default=256, help="tokens per rank and step")
    parser.add_argument("--contenders", default="zero3")
    parser.add_argument("--codegen", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (MixedPrecision)")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument(
        "--kill",
        action="store_true",
        help="with --checkpoint: after the checked step, rank 1 is SIGKILLed halfway into one "
        "more step; the resume then starts from the sealed checkpoint alone",
    )
    parser.add_argument(
        "--compile-once",
        action="store_true",
        help="z3.compile_once(the decoder layers): each kind of layer compiled once",
    )
    parser.add_argument(
        "--compute-layers",
        default="",
        help="e.g. 1,4: measure compute alone (in memory at these depths, a line fitted, "
        "extrapolated)",
    )
    parser.add_argument(
        "--compute-repeats",
        type=int,
        default=1,
        help="runs per --compute-layers depth, the depths alternated",
    )
    parser.add_argument("--cache", default=results_dir("big", "checkpoints"))
    parser.add_argument("--scratch", default=results_dir("big", "scratch"))
    parser.add_argument("--out", default=results_dir("big"))
    parser.add_argument("--skip-disk-test", action="store_true")
    parser.add_argument(
        "--ds-config", default="",
        help='JSON merged into the deepspeed contender\'s config, e.g. \'{"aio": {"queue_depth": 16}}\'',
    )  # fmt: skip
    parser.add_argument(
        "--thp", action="store_true",
        help="ranks started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1: glibc's mmap'd buffers "
        "in transparent huge pages, fewer page faults (tensors of 1 MiB and more are the host "
        "cache's blocks once a disk store opens: add ZERO3_HOST_CACHE_MB=0 to measure glibc's)",
    )  # fmt: skip
    parser.add_argument(
        "--zero3-options", default="",
        help='JSON merged into the zero3 contender\'s compile options, e.g. \'{"reload_depth": 4}\'',
    )  # fmt: skip
    parser.add_argument(
        "--io-trace", action="store_true",
        help="record the steady steps' store transfers, then replay them with nothing else "
        "running (both ranks at once): the disk's time for the step's own I/O pattern",
    )  # fmt: skip
    parser.add_argument(
        "--switch-interval", type=float, default=0.0,
        help="the ranks' sys.setswitchinterval in seconds (Python's default 0.005): how long an "
        "I/O thread may wait for the GIL the training thread holds",
    )  # fmt: skip
    parser.add_argument(
        "--cold", action="store_true",
        help="drop the page cache before each contender (root): the load reads the disk",
    )  # fmt: skip
    return parser.parse_args(argv)


def config_of(shape: Shape, layers: int | None = None):
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=layers or shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )


# --------------------------------------------------------------------------- the checkpoint


def write_checkpoint(folder: str, shape: Shape, layers: int | None = None) -> str:
    """A random-init bf16 checkpoint written tensor by tensor (never the whole model)."""
    import transformers
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        return folder
    staging = folder + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    config = config_of(shape, layers)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    config.save_pretrained(staging)
    generator = torch.Generator().manual_seed(0)
    weight_map, file_index, pending, pending_bytes, total = {}, 0, {}, 0, 0

    def flush():
        nonlocal file_index, pending, pending_bytes
        if not pending:
            return
        name = f"model-{file_index:05d}.safetensors"
        save_file(pending, os.path.join(staging, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in pending})
        file_index, pending, pending_bytes = file_index + 1, {}, 0

    for name, param in model.state_dict().items():
        if shape.tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            value = torch.empty(param.shape, dtype=torch.float32)
            value.normal_(0.0, 0.02, generator=generator)
            value = value.to(torch.bfloat16)
        pending[name] = value
        pending_bytes += value.numel() * 2
        total += value.numel() * 2
        if pending_bytes >= 2 * GiB:
            flush()
    flush()
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    os.replace(staging, folder)
    return folder


# --------------------------------------------------------------------------- measuring


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _proc_io() -> dict[str, int]:
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            values[key] = int(value)
    return values


def _cpu_seconds(path: str) -> float:
    """User + system CPU seconds of a /proc stat file (a process's or one thread's)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _disk_busy_ms(device: tuple[int, int] | None) -> int:
    """Milliseconds the block device ``(major, minor)`` had requests in flight since boot
    (``/proc/diskstats``' io_ticks; the whole device: every rank's I/O, not one process's)."""
    if device is None:
        return 0
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if (int(fields[0]), int(fields[1])) == device:
                return int(fields[12])
    return 0


def _device_of(folder: str) -> tuple[int, int] | None:
    """The block device whose /proc/diskstats line counts ``folder``'s I/O (the whole disk of a
    partition); None where there is none (an overlay, tmpfs)."""
    os.makedirs(folder, exist_ok=True)
    dev = os.stat(folder).st_dev
    device = (os.major(dev), os.minor(dev))
    sys_path = f"/sys/dev/block/{device[0]}:{device[1]}"
    if not os.path.exists(sys_path):
        return None
    if os.path.exists(os.path.join(sys_path, "partition")):  # the disk it is a part of
        with open(os.path.join(os.path.realpath(sys_path), "..", "dev")) as f:
            major, minor = f.read().split(":")
        device = (int(major), int(minor))
    return device


class Phases:
    """Per phase: seconds, peak RSS (VmHWM reset at its start), bytes moved, exposed I/O, the
    scratch disk's busy time."""

    def __init__(self, scratch: str | None = None):
        self.records: dict[str, dict] = {}
        self.model = None
        self.opt = None
        self.device = _device_of(scratch) if scratch else None
        self.trace: IoTrace | None = None  # on during the steady steps (``--io-trace``)

    def _counters(self) -> dict:
        stores = _stores(self.model, self.opt) if self.model is not None else []
        io = _proc_io()
        return {
            "store_read": sum(s.bytes_read for s in stores),
            "store_written": sum(s.bytes_written for s in stores),
            "io_s": sum(s.io_seconds for s in stores),
            "wait_s": sum(s.wait_seconds for s in stores),
            "disk_read": io.get("read_bytes", 0),
            "disk_written": io.get("write_bytes", 0),
            # CPU of the training thread and of all the process's threads (I/O threads, the
            # in-backward stepping thread, the kernel's page-cache copies on their behalf)
            "cpu_main_s": _cpu_seconds(f"/proc/self/task/{os.getpid()}/stat"),
            "cpu_s": _cpu_seconds("/proc/self/stat"),
            "disk_busy_s": _disk_busy_ms(self.device) / 1e3,
        }

    @contextlib.contextmanager
    def phase(self, name: str, settle: bool = True):
        """``settle``: collect garbage and return freed memory to the system first (not
        inside a step, where a training loop would not)."""
        if settle:
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start_rss = _status_kib("VmRSS") * 1024
        print(f"[phase] {name}: starts at {start_rss / 1e9:.2f} GB resident", flush=True)
        before = self._counters()
        traced = self.trace is not None and name == "steps"
        if traced:
            self.trace.on = True
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        if traced:
            self.trace.on = False
        after = self._counters()
        self.records[name] = {
            "seconds": seconds,
            "peak_rss": _status_kib("VmHWM") * 1024,
            "start_rss": start_rss,
            **{k: after[k] - before[k] for k in after},
        }

    @contextlib.contextmanager
    def part(self, name: str):
        """A part of a measured phase, summed over its repetitions (the steady steps' forward,
        backward and optimizer): seconds and bytes, not memory (the enclosing phase's peak
        stays whole)."""
        before = self._counters()
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        after = self._counters()
        record = self.records.setdefault(name, {"seconds": 0.0, **dict.fromkeys(after, 0)})
        if self.trace is not None and name == "steps: forward":
            self.trace.marks.append(start)
        record["seconds"] += seconds
        for key in after:
            record[key] += after[key] - before[key]


def _batch(step: int, rank: int, seq: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (1, seq), generator=gen)


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
        ids = _batch(i, rank, cfg["seq"], cfg["vocab"])
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


def _digest(model) -> str:
    import zero3_compile as z3  # noqa: F401

    sha = hashlib.sha256()
    for name, state in model.sharded_parameters():
        from zero3_compile.offload.params import loaded

        with loaded([state] if state.offload is not None else [], write_back=False):
            sha.update(name.encode())
            # a copy: a numpy view would pin the storage, which eviction then cannot free
            sha.update(state.local().detach().clone().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _offload(z3, cfg: dict, scratch: str):
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


def run_zero3(rank, world, cfg: dict):
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if cfg.get("switch_interval"):
        sys.setswitchinterval(cfg["switch_interval"])
    dist.init_process_group("gloo")
    phases = Phases(cfg["scratch"])
    if cfg.get("io_trace"):
        phases.trace = IoTrace()
    scratch = os.path.join(cfg["scratch"], f"run-{cfg['tag']}")
    offload = _offload(z3, cfg, scratch)
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg.get("fused_adamw", False))
    if cfg["offload"] == "disk":
        opt = z3.offload_optimizer(
            opt,
            tier="disk",
            path=scratch,
            double_buffer=not cfg["single_copy"],
            tile_mb=cfg.get("tile_mb", 64.0),
            o_direct=cfg.get("o_direct", False),
            in_backward=cfg.get("in_backward", False),
            threads=cfg.get("io_threads", 4),
        )
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
        result["after_save_digest"] = _digest(model)
        if cfg.get("kill"):
            _killed_mid_step(rank, cfg, result, step, steps + 1)
    dist.barrier()
    if phases.trace is not None:  # last: the replay overwrites the stores' values
        result["io_trace"] = phases.trace.summary()
        phases.trace.save(os.path.join(cfg["out"], f"io-trace-{cfg['tag']}-rank{rank}.json"))
        dist.barrier()
        # the last step's transfers as traced, then as sequential as they can be, twice each in
        # turn (the disk's rate drifts by the minute): the step's pattern against its bytes
        stores, events = _stores(model, opt), phases.trace.last_step()
        result["io_trace"]["replays"] = []
        for order in ("traced", "sorted", "traced", "sorted"):
            dist.barrier()
            result["io_trace"]["replays"].append(phases.trace.replay(stores, events, order))
        dist.barrier()
    return result


def _kill_result(cfg: dict, rank: int) -> str:
    return os.path.join(cfg["out"], f"killed-{cfg['tag']}-rank{rank}.json")


def _killed_mid_step(rank: int, cfg: dict, result: dict, step, index: int) -> None:
    """``--kill``: this rank's result goes to a file, then rank 1 is SIGKILLed halfway into one
    more step (its collectives, offload reads and writes in flight) and rank 0 fails in it or
    at the barrier after it; never returns."""
    with open(_kill_result(cfg, rank), "w") as f:
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


def _left_behind(scratch: str) -> list[str]:
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

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo")
    phases = Phases(cfg["scratch"])
    scratch = os.path.join(cfg["scratch"], "run-resume")
    offload = _offload(z3, cfg, scratch)
    policy = z3.MixedPrecision(torch.bfloat16, torch.float32) if cfg["bf16"] else None
    model = z3hf.from_pretrained(
        transformers.AutoModelForCausalLM, cfg["checkpoint_model"], dtype=torch.float32,
        offload=offload, mp_policy=policy,
    )  # fmt: skip
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg.get("fused_adamw", False))
    if cfg["offload"] == "disk":
        opt = z3.offload_optimizer(
            opt,
            tier="disk",
            path=scratch,
            double_buffer=not cfg["single_copy"],
            tile_mb=cfg.get("tile_mb", 64.0),
            o_direct=cfg.get("o_direct", False),
            threads=cfg.get("io_threads", 4),
        )
    phases.model, phases.opt = model, opt
    path = os.path.join(cfg["scratch"], "checkpoint")
    with phases.phase("checkpoint load"):
        state = z3.load_checkpoint(path, model, opt)
    step_model = torch.compile(model, backend="zero3", options=_options(cfg))
    ids = _batch(state["step"], rank, cfg["seq"], cfg["vocab"])
    loss = step_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return {"phases": phases.records, "loss": loss.item(), "digest": _digest(model)}


def _options(cfg: dict) -> dict:
    """The zero3 compile options of a run: its codegen and ``--zero3-options``."""
    return {"codegen": cfg["codegen"], **cfg.get("zero3_options", {})}


def run_compute(rank, world, cfg: dict):
    """The step without I/O: the same width at ``layers`` depth, in memory."""
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
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
        ids = _batch(i, rank, cfg["seq"], cfg["vocab"])
        start = time.perf_counter()
        step_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:])}


def run_fsdp2(rank, world, cfg: dict):
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
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

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    deepspeed.init_distributed(dist_backend="gloo")
    from bench.harness.contenders import Context, OptimConfig, deepspeed_config

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


# --------------------------------------------------------------------------- the step's I/O


class IoTrace:
    """Every transfer of the offload stores while ``on`` (``--io-trace``: the steady steps):
    start and end times, the store's file, offset, bytes, direction. ``replay`` then moves the
    same requests on the same files again with nothing else running: the disk's time for the
    step's own pattern (sizes, offsets, concurrency), to set beside the step's and the
    sequential test's."""

    def __init__(self):
        from zero3_compile.offload.store import DiskStore

        self.on = False
        self.events: list[tuple] = []  # (start, end, path, offset, nbytes, write)
        self.marks: list[float] = []  # each traced step's start
        original = DiskStore._transfer
        trace = self

        def traced(store, tensor, offset, nbytes, write):
            start = time.perf_counter()
            try:
                return original(store, tensor, offset, nbytes, write)
            finally:
                if trace.on:  # list.append: atomic under the GIL, from any I/O thread
                    trace.events.append(
                        (start, time.perf_counter(), store.path, offset, nbytes, write)
                    )

        DiskStore._transfer = traced

    def save(self, path: str) -> None:
        """The transfers as JSON rows (start and end in seconds from the first one's start,
        the store's file name, offset, bytes, write), to study after the run."""
        events = sorted(self.events)
        first = events[0][0] if events else 0.0
        with open(path, "w") as f:
            json.dump(
                [
                    [round(a - first, 6), round(b - first, 6), os.path.basename(p), o, n, w]
                    for a, b, p, o, n, w in events
                ],
                f,
            )

    def summary(self) -> dict:
        """Bytes, the time at least one transfer was in flight (``busy_s``) and the mean number
        in flight then, and the transfers' sizes."""
        events = sorted(self.events)
        busy, end = 0.0, float("-inf")  # the union of the transfers' intervals
        for start, stop, *_ in events:
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        inflight = sum(stop - start for start, stop, *_ in events)
        sizes = sorted(e[4] for e in events)
        return {
            "transfers": len(events),
            "read": sum(e[4] for e in events if not e[5]),
            "written": sum(e[4] for e in events if e[5]),
            "busy_s": busy,
            "mean_in_flight": inflight / busy if busy else 0.0,
            "median_bytes": sizes[len(sizes) // 2] if sizes else 0,
        }

    def last_step(self) -> list[tuple]:
        """The events of the last traced step (from its forward's start)."""
        since = self.marks[-1] if self.marks else 0.0
        return sorted(e for e in self.events if e[0] >= since)

    def replay(self, stores: list, events: list[tuple], order: str = "traced") -> dict:
        """``events`` again, on each store's file through a pool of that store's threads, as
        fast as they go (no compute, no waits between them). ``order``: "traced", in the order
        they started; "sorted", the same transfers with each store's reads and its writes in
        ascending offsets, reads and writes of every store interleaved in proportion to their
        bytes (the step's bytes moved as sequentially as they can be). The values are
        overwritten: only after the run is done with them."""
        from concurrent.futures import ThreadPoolExecutor

        by_path = {s.path: s for s in stores if hasattr(s, "fd")}
        events = [e for e in events if e[2] in by_path]
        if order == "sorted":
            streams: dict[tuple, list] = {}
            for e in events:
                streams.setdefault((e[2], e[5]), []).append(e)
            keyed = []
            for stream in streams.values():
                stream.sort(key=lambda e: e[3])
                total, done = sum(e[4] for e in stream), 0
                for e in stream:
                    keyed.append((done / total, e))
                    done += e[4]
            events = [e for _, e in sorted(keyed, key=lambda k: k[0])]
        largest = max((e[4] for e in events), default=0)
        local = threading.local()

        def move(fd: int, offset: int, nbytes: int, write: bool) -> None:
            buffer = getattr(local, "buffer", None)
            if buffer is None:  # page-aligned (O_DIRECT), one per thread
                buffer = local.buffer = mmap.mmap(-1, -(-largest // 4096) * 4096)
            view = memoryview(buffer)[: -(-nbytes // 4096) * 4096]  # O_DIRECT: whole blocks
            call = os.pwritev if write else os.preadv
            done = 0
            while done < len(view):
                n = call(fd, [view[done:]], offset + done)
                if n <= 0:  # a read past the file's end (a region's tail rounded up)
                    break
                done += n

        pools = {
            path: ThreadPoolExecutor(max_workers=store.pool._max_workers)
            for path, store in by_path.items()
        }
        start = time.perf_counter()
        futures = [pools[e[2]].submit(move, by_path[e[2]].fd, e[3], e[4], e[5]) for e in events]
        for future in futures:
            future.result()
        for store in by_path.values():
            os.fsync(store.fd)
        seconds = time.perf_counter() - start
        for pool in pools.values():
            pool.shutdown()
        return {"order": order, "seconds": seconds, "bytes": sum(e[4] for e in events)}


# --------------------------------------------------------------------------- the disk


STREAMS = (1, 2, 4)  # concurrent requests the disk test tries; the bound takes the best rate


def disk_bandwidth(folder: str, size: int = 2 * GiB, block: int = 16 * 2**20) -> dict:
    """Sequential write, read, and both at once with O_DIRECT, 16 MiB blocks (GB/s), each the
    best over 1, 2 and 4 streams (threads, each on its own contiguous part of the file): the
    offload stores keep many requests in flight, and a disk (a virtual one especially) may only
    reach its rate with several; a bound taken at one stream's rate could be beaten. Dirty pages
    (a checkpoint just written) are written back first, so they do not share the disk with it."""
    os.sync()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "bandwidth.bin")
    other = os.path.join(folder, "bandwidth-mixed.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fd, out = os.open(path, flags, 0o600), os.open(other, flags, 0o600)
    best = {"write_gbps": 0.0, "read_gbps": 0.0, "mixed_gbps": 0.0}
    streams = {}
    try:
        os.posix_fallocate(out, 0, size)
        for n in STREAMS:
            write_s = _streamed(n, [(fd, os.pwritev)], size, block)
            read_s = _streamed(n, [(fd, os.preadv)], size, block)
            # the traffic of an offloaded backward: it reads and writes state at once
            both_s = _streamed(n, [(fd, os.preadv), (out, os.pwritev)], size, block)
            rates = {
                "write_gbps": size / write_s / 1e9,
                "read_gbps": size / read_s / 1e9,
                "mixed_gbps": 2 * size / both_s / 1e9,
            }
            for key, rate in rates.items():
                if rate > best[key]:
                    best[key], streams[key] = rate, n
    finally:
        os.close(fd)
        os.close(out)
        os.remove(path)
        os.remove(other)
    return {**best, "streams": streams}


def _streamed(n: int, jobs: list, size: int, block: int) -> float:
    """Seconds for ``n`` threads per (fd, call) in ``jobs`` to move ``size`` bytes of each file in
    ``block``-byte calls, thread i over the i-th of ``n`` contiguous parts; writes are synced."""
    blocks = size // block
    parts = [(i * blocks // n, (i + 1) * blocks // n) for i in range(n)]

    def run(fd: int, call, first: int, last: int) -> None:
        buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        buffer.write(os.urandom(block))
        for index in range(first, last):
            call(fd, [buffer], index * block)

    threads = [
        threading.Thread(target=run, args=(fd, call, first, last))
        for fd, call in jobs
        for first, last in parts
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for fd, call in jobs:
        if call is os.pwritev:
            os.fsync(fd)
    return time.perf_counter() - start


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only), so the next read is the disk's."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError as error:
        raise SystemExit(f"--cold needs root to drop the page cache: {error}") from error


# --------------------------------------------------------------------------- report


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def _busy(record: dict) -> str:
    """The share of a phase the scratch disk had requests in flight (any process's)."""
    busy = record.get("disk_busy_s", 0.0)
    return f"{busy / record['seconds']:.0%}" if busy and record["seconds"] else "-"


def report(args, shape, disk, runs, compute) -> str:
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


def measure_compute(args, shape: Shape, base: dict, depths: list[int], logs: str, env: dict):
    """The step without I/O at the full depth, from in-memory runs at ``depths``: the depths
    alternated ``--compute-repeats`` times (the machine's speed drifts between runs), a line
    fitted through every run's step time. Prints each run, the fit and the spread of the
    extrapolations of each repetition on its own."""
    samples: list[tuple[int, int, float]] = []  # (repetition, depth, seconds)
    for rep in range(args.compute_repeats):
        for depth in depths:
            small = write_checkpoint(
                os.path.join(args.cache, f"{args.model}-l{depth}"), shape, depth
            )
            per_rank = run_ranks(run_compute, args.world, ({**base, "checkpoint": small},),
                                 log_dir=logs, name=f"compute-l{depth}-r{rep}", timeout_s=7200,
                                 env=env)  # fmt: skip
            seconds = max(r["step_s"] for r in per_rank)
            samples.append((rep, depth, seconds))
            print(
                f"compute alone: {seconds:.2f} s at {depth} layers (repetition {rep})", flush=True
            )

    def at_full_depth(runs):  # least squares through (depth, seconds), at the model's depth
        line = statistics.linear_regression([d for _, d, _ in runs], [t for _, _, t in runs])
        return line.intercept + line.slope * shape.layers, line

    compute, line = at_full_depth(samples)
    each = [
        at_full_depth([x for x in samples if x[0] == rep])[0] for rep in range(args.compute_repeats)
    ]
    print(f"compute alone at {shape.layers} layers: {compute:.1f} s ({line.intercept:.2f} s + {line.slope:.3f} s a "
          f"layer, fitted to {len(samples)} runs); each repetition alone "
          f"{', '.join(f'{x:.1f}' for x in each)} s", flush=True)  # fmt: skip
    return compute


def main(argv=None) -> None:
    args = parse_args(argv)
    shape = SHAPES[args.model]
    model_name = args.model
    if args.layers:
        shape, model_name = replace(shape, layers=args.layers), f"{args.model}-l{args.layers}"
    os.makedirs(args.out, exist_ok=True)
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.world))}
    if args.thp:  # read by glibc at process start: the ranks' environment, not a call
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    logs = os.path.join(args.out, "logs")
    checkpoint = write_checkpoint(os.path.join(args.cache, model_name), shape)
    disk = None if args.skip_disk_test else disk_bandwidth(args.scratch)
    base = dict(checkpoint=checkpoint, scratch=args.scratch, offload=args.offload, grads=args.grads,
                single_copy=args.single_copy, o_direct=args.o_direct, io_threads=args.io_threads,
                tile_mb=args.tile_mb, in_backward=args.in_backward, fused_adamw=args.fused_adamw,
                seq=args.seq, vocab=shape.vocab, hidden=shape.hidden, steps=args.steps, codegen=args.codegen,
                bf16=args.bf16, checkpoint_model=checkpoint,
                compile_once=args.compile_once, ds_config=args.ds_config,
                zero3_options=json.loads(args.zero3_options or "{}"),
                io_trace=args.io_trace, out=args.out,
                switch_interval=args.switch_interval)  # fmt: skip
    compute = None
    depths = [int(x) for x in args.compute_layers.split(",") if x]
    if len(set(depths)) >= 2:
        compute = measure_compute(args, shape, base, depths, logs, env)
    runs, failed = {}, {}
    for name in [c for c in args.contenders.split(",") if c]:
        cfg = {**base, "tag": name, "save": args.checkpoint}
        if args.cold:
            drop_page_cache()
        # the contender before may have left its swap files (DeepSpeed's stay until its
        # process ends; a killed one leaves them): the next one needs the disk
        shutil.rmtree(args.scratch, ignore_errors=True)
        fn = {"zero3": run_zero3, "fsdp2": run_fsdp2, "deepspeed": run_deepspeed}[name]
        extra = {"DS_ACCELERATOR": "cpu"} if name == "deepspeed" else {}
        kill = name == "zero3" and args.checkpoint and args.kill
        cfg["kill"] = kill
        for rank in range(args.world):
            with contextlib.suppress(FileNotFoundError):
                os.remove(_kill_result(cfg, rank))
        try:
            per_rank = run_ranks(fn, args.world, (cfg,), log_dir=logs, name=name,
                                 timeout_s=14400, env={**env, **extra})  # fmt: skip
        except RankError as error:
            # the first line names the rank; the last, what stopped it (the traceback's end)
            lines = str(error).splitlines()
            if not (kill and all(os.path.exists(_kill_result(cfg, r)) for r in range(args.world))):
                # an OOM kill is a result: say so and go on
                failed[name] = " ".join(lines[:1] + lines[-1:])[:400]
                print(f"{name}: failed:\n{error}", flush=True)
                continue
            per_rank = []
            for rank in range(args.world):
                with open(_kill_result(cfg, rank)) as f:
                    per_rank.append(json.load(f))
            left = _left_behind(args.scratch)
            per_rank[0]["killed"] = (
                f"rank 1 SIGKILLed halfway into step {args.steps + 2}: {lines[0][:100]} "
                f"{lines[-1][:200]}; files left in the offload folder: "
                f"{len(left)}{' ' + ', '.join(left[:4]) if left else ''}"
            )
            print(per_rank[0]["killed"], flush=True)
        if name == "zero3" and args.checkpoint:
            resumed = run_ranks(run_resume, args.world, (cfg,), log_dir=logs, name="resume",
                                timeout_s=14400, env=env)  # fmt: skip
            same = all(
                r["digest"] == p["after_save_digest"] and r["loss"] == p["after_save_loss"]
                for r, p in zip(resumed, per_rank)
            )
            load_s = max(r["phases"]["checkpoint load"]["seconds"] for r in resumed)
            per_rank[0]["resume"] = (
                f"resume in new processes: checkpoint loaded in {load_s:.1f} s "
                f"({per_rank[0]['checkpoint_bytes'] / load_s / 1e9:.2f} GB/s); the next step "
                f"{'bit-identical' if same else 'DIFFERS'} (loss and every shard)"
            )
        runs[name] = per_rank
    shutil.rmtree(args.scratch, ignore_errors=True)  # offload files are unlinked already
    if disk and args.io_trace:  # the disk's rate drifts: measured again beside the replays
        disk["after"] = disk_bandwidth(args.scratch)
        shutil.rmtree(args.scratch, ignore_errors=True)
    text = report(args, shape, disk, runs, compute)
    text += "".join(f"\n## {name}\n\nfailed: {why}\n" for name, why in failed.items())
    print(text)
    # the model's name: the loop above reuses ``name`` for the contenders
    tag = f"{model_name}-{args.offload}-w{args.world}"
    with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
        json.dump({"args": vars(args), "shape": asdict(shape), "disk": disk, "runs": runs,
                   "compute_s": compute}, f, indent=1, default=str)  # fmt: skip


if __name__ == "__main__":
    main()
