"""The checkpoint load of a model whose state is on disk, measured on its own.

    python -m bench.checkpoint_load --model llama-1.5b --make     # train a step, save (once)
    python -m bench.checkpoint_load --model llama-1.5b --repeats 2
    python -m bench.checkpoint_load --model llama-1.5b --hold-gb 14   # a smaller page cache

``--make`` loads the Llama of ``bench/big_model.py`` from its bf16 Hugging Face checkpoint
(written once under ``--cache``) with parameters, gradients and AdamW state on disk (one copy,
O_DIRECT stores, the optimizer in the backward, bf16 compute), trains one step and saves a sealed
checkpoint under ``--scratch``. Each repetition then starts new processes that load the model
from the Hugging Face checkpoint, drop the page cache (root) and time ``z3.load_checkpoint`` into
the offloaded model and optimizer: seconds (its verification, DCP's load and the state-dict
setting apart when they are separate calls), bytes read from and written to the disk, the peak
resident memory of each rank above where it started, and a digest of the loaded shards (equal
across code versions that load the same values). ``--hold-gb`` keeps that much memory resident
in another process meanwhile: the page cache then cannot hold the checkpoint, as on a machine
whose memory the job uses. Run it alone; ``--clean`` deletes the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import shutil
import time

import torch
import torch.distributed as dist

from bench.harness.big_contenders import offload_of, run_zero3, shard_digest
from bench.harness.disk import drop_page_cache
from bench.harness.launch import run_ranks, set_rank_threads
from bench.harness.llama import SHAPES, write_checkpoint
from bench.harness.paths import results_dir
from bench.harness.proc import proc_io, reset_rss_high_water, status_kib


def _config(args, checkpoint: str, shape) -> dict:
    return dict(
        checkpoint=checkpoint, checkpoint_model=checkpoint, scratch=args.scratch, offload="disk",
        grads="disk", single_copy=True, o_direct=True, io_threads=4, tile_mb=64.0,
        in_backward=True, fused_adamw=True, seq=256, vocab=shape.vocab, hidden=shape.hidden,
        steps=1, codegen="eager", bf16=True, compile_once=False, ds_config="", zero3_options={},
        io_trace=False, out=args.out, switch_interval=0.0, tag="make", save=True, kill=False,
    )  # fmt: skip


def load(rank, world, cfg: dict) -> dict:
    """New processes: the model and optimizer as a resumed job builds them, then the load."""
    import torch.distributed.checkpoint as dcp
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf
    from zero3_compile.io.checkpoint import api as checkpoint_api

    set_rank_threads(world)
    dist.init_process_group("gloo")
    scratch = os.path.join(cfg["scratch"], "run-load")
    model = z3hf.from_pretrained(
        transformers.AutoModelForCausalLM, cfg["checkpoint_model"], dtype=torch.float32,
        offload=offload_of(z3, cfg, scratch),
        mp_policy=z3.MixedPrecision(torch.bfloat16, torch.float32),
    )  # fmt: skip
    opt = z3.offload_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
        tier="disk", path=scratch, double_buffer=False, o_direct=True,
    )  # fmt: skip
    parts: dict[str, float] = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - start

        return call

    # the separate calls a version of load_checkpoint makes, where it makes them
    for name in ("verify_checkpoint", "set_state_dict"):
        if hasattr(checkpoint_api, name):
            setattr(checkpoint_api, name, timed(name, getattr(checkpoint_api, name)))
    dcp.load = timed("dcp.load", dcp.load)  # the module load_checkpoint calls it through
    if rank == 0:
        drop_page_cache()
    dist.barrier()
    reset_rss_high_water()
    start_rss = status_kib("VmRSS") * 1024
    before = proc_io()
    start = time.perf_counter()
    z3.load_checkpoint(os.path.join(cfg["scratch"], "checkpoint"), model, opt)
    seconds = time.perf_counter() - start
    after = proc_io()
    return {
        "seconds": seconds,
        "parts": parts,
        "read_gb": (after["read_bytes"] - before["read_bytes"]) / 1e9,
        "written_gb": (after["write_bytes"] - before["write_bytes"]) / 1e9,
        "peak_above_start_gb": (status_kib("VmHWM") * 1024 - start_rss) / 1e9,
        "digest": shard_digest(model),
    }


def _hold(gigabytes: float, ready) -> None:
    """Keep ``gigabytes`` of anonymous memory resident until killed."""
    size = int(gigabytes * 2**30)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, size, mmap.PAGESIZE):
        memory[offset] = 1
    ready.set()
    while True:
        time.sleep(60)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama-1.5b")
    parser.add_argument("--make", action="store_true", help="train a step and save first")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hold-gb", type=float, default=0.0)
    parser.add_argument("--clean", action="store_true", help="delete the checkpoint at the end")
    parser.add_argument("--cache", default=results_dir("big", "checkpoints"))
    parser.add_argument("--scratch", default=results_dir("ckload", "scratch"))
    parser.add_argument("--out", default=results_dir("ckload"))
    args = parser.parse_args(argv)
    shape = SHAPES[args.model]
    checkpoint = write_checkpoint(os.path.join(args.cache, args.model), shape)
    cfg = _config(args, checkpoint, shape)
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    logs = os.path.join(args.out, "logs")
    if args.make:
        shutil.rmtree(args.scratch, ignore_errors=True)
        made = run_ranks(run_zero3, 2, (cfg,), log_dir=logs, name="make",
                         timeout_s=7200, env=env)  # fmt: skip
        print(f"saved {made[0]['checkpoint_bytes'] / 1e9:.2f} GB after losses {made[0]['losses']}")
    holder = None
    if args.hold_gb:
        ready = multiprocessing.Event()
        holder = multiprocessing.Process(target=_hold, args=(args.hold_gb, ready), daemon=True)
        holder.start()
        ready.wait()
        print(f"holding {args.hold_gb} GB resident in another process", flush=True)
    try:
        for repeat in range(args.repeats):
            shutil.rmtree(os.path.join(args.scratch, "run-load"), ignore_errors=True)
            per_rank = run_ranks(load, 2, (cfg,), log_dir=logs, name=f"load-{repeat}",
                                 timeout_s=7200, env=env)  # fmt: skip
            for rank, result in enumerate(per_rank):
                print(f"load {repeat} rank {rank}: {json.dumps(result)}", flush=True)
    finally:
        if holder is not None:
            holder.kill()
        if args.clean:
            shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
