"""Models larger than the machine: a Llama loaded from a Hugging Face checkpoint into shards,
trained with parameters and optimizer state on disk, phase by phase.

    python -m bench.big_model --model llama-1b --world 2 --offload disk --steps 3
    python -m bench.big_model --model llama-1.5b --world 2 --offload disk --steps 3 --checkpoint
    python -m bench.big_model --model llama-3b --world 2 --offload disk --steps 3
    python -m bench.big_model --model llama-1b --contenders zero3,fsdp2,deepspeed --offload none

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
import json
import os
import shutil
import statistics
from dataclasses import asdict, replace

from bench.harness.big_contenders import (
    CONTENDERS,
    kill_result,
    left_behind,
    run_compute,
    run_resume,
)
from bench.harness.big_report import report
from bench.harness.disk import disk_bandwidth, drop_page_cache
from bench.harness.launch import RankError, run_ranks
from bench.harness.llama import SHAPES, Shape, write_checkpoint
from bench.harness.paths import results_dir


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
        fn = CONTENDERS[name]
        extra = {"DS_ACCELERATOR": "cpu"} if name == "deepspeed" else {}
        kill = name == "zero3" and args.checkpoint and args.kill
        cfg["kill"] = kill
        for rank in range(args.world):
            with contextlib.suppress(FileNotFoundError):
                os.remove(kill_result(cfg, rank))
        try:
            per_rank = run_ranks(fn, args.world, (cfg,), log_dir=logs, name=name,
                                 timeout_s=14400, env={**env, **extra})  # fmt: skip
        except RankError as error:
            # the first line names the rank; the last, what stopped it (the traceback's end)
            lines = str(error).splitlines()
            if not (kill and all(os.path.exists(kill_result(cfg, r)) for r in range(args.world))):
                # an OOM kill is a result: say so and go on
                failed[name] = " ".join(lines[:1] + lines[-1:])[:400]
                print(f"{name}: failed:\n{error}", flush=True)
                continue
            per_rank = []
            for rank in range(args.world):
                with open(kill_result(cfg, rank)) as f:
                    per_rank.append(json.load(f))
            left = left_behind(args.scratch)
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
