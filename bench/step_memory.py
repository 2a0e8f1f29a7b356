"""Where a training step's peak resident memory comes from: VmHWM reset around the forward, the
backward and ``opt.step()`` of each step, on 2 ranks, a Hugging Face checkpoint loaded into shards.

    python -m bench.step_memory CHECKPOINT OFFLOAD MIXED TRIM
    python -m bench.step_memory ~/.cache/zero3_compile/bench/big/checkpoints/llama-1.3b 1 0 1

OFFLOAD 1: parameters and AdamW state on disk, 2: gradient shards too; MIXED 1: bf16 compute; TRIM 1: free and trim the
allocator between phases (what remains is what the phase holds). Checkpoints: bench/big_model.py.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from bench.harness.launch import run_ranks
from bench.harness.proc import reset_rss_high_water, settle, status_kib


def kib(field):
    return status_kib(field) / 2**20  # GiB


def note(rank, step, key, value):
    print(f"[rank {rank}] step {step} {key} {value:.2f} GiB", file=sys.stderr, flush=True)


def reset():
    settle()
    reset_rss_high_water()


def rank_fn(rank, world, ckpt, offload, mp, trim):
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf
    from zero3_compile.offload.grads import spooled

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    scratch = tempfile.mkdtemp(prefix=f"zero3-step-memory-{rank}-")
    os.makedirs(scratch, exist_ok=True)
    grads = "disk" if offload == 2 else None
    off = z3.Offload(params="disk", grads=grads, path=scratch) if offload else None
    pol = z3.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    model = z3hf.from_pretrained(
        transformers.AutoModelForCausalLM, ckpt, dtype=torch.float32, offload=off, mp_policy=pol
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if offload:
        opt = z3.offload_optimizer(opt, tier="disk", path=scratch)
    sm = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    out = []
    for step in range(3):
        ids = torch.randint(
            0,
            model.config.vocab_size,
            (1, 256),
            generator=torch.Generator().manual_seed(step * 10 + rank),
        )
        rec = {}
        reset()
        rec["start"] = kib("VmRSS")
        loss = sm(input_ids=ids, labels=ids).loss
        rec["fwd_peak"] = kib("VmHWM")
        note(rank, step, "fwd_peak", rec["fwd_peak"])
        rec["after_fwd"] = kib("VmRSS")
        note(rank, step, "after_fwd", rec["after_fwd"])
        if trim:
            reset()
        loss.backward()
        rec["bwd_peak"] = kib("VmHWM")
        note(rank, step, "bwd_peak", rec["bwd_peak"])
        rec["after_bwd"] = kib("VmRSS")
        note(rank, step, "after_bwd", rec["after_bwd"])
        gsz = (
            sum(
                p.grad.to_local().numel() * 4
                for p in model.parameters()
                if p.grad is not None and spooled(p) is None
            )
            / 2**30
        )
        rec["grad_shards"] = gsz
        if trim:
            reset()
        opt.step()
        rec["opt_peak"] = kib("VmHWM")
        note(rank, step, "opt_peak", rec["opt_peak"])
        rec["after_opt"] = kib("VmRSS")
        note(rank, step, "after_opt", rec["after_opt"])
        opt.zero_grad(set_to_none=True)
        reset()
        rec["end"] = kib("VmRSS")
        out.append({k: round(v, 2) for k, v in rec.items()})
    dist.barrier()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a Hugging Face checkpoint folder")
    parser.add_argument("offload", type=int, choices=[0, 1, 2])
    parser.add_argument("mixed", choices=["0", "1"], help="1: bf16 compute")
    parser.add_argument("trim", choices=["0", "1"], help="1: free and trim between phases")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    res = run_ranks(
        rank_fn,
        2,
        (args.checkpoint, args.offload, args.mixed == "1", args.trim == "1"),
        log_dir=tempfile.mkdtemp(prefix="zero3-step-memory-logs-"),
        name="probe",
        timeout_s=3000,
    )
    for r, steps in enumerate(res):
        for s in steps:
            print("rank", r, s)
