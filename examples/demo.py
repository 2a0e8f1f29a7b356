"""Train a small GPT with ZeRO-3 through torch.compile on CPU ranks.

    torchrun --standalone --nproc-per-node 2 examples/demo.py [--codegen eager] [--steps 8] [--layers 4]

Prints the loss of every step and, per rank, the bytes of parameters, gradients and AdamW state
against the unsharded model, and the collectives one training step issues. On gloo (CPU) a
gradient reduction shows as ``all_reduce_sum``: gloo has no reduce-scatter of its own, so zero3
all-reduces the bucket in place and keeps this rank's rows (same bytes); on NCCL it is a
``reduce_scatter``. Runs from a clone with ``pip install -e .`` (no test code needed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero3_compile as z3
from zero3_compile.compiler.signature import collective_signature

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: gpt_model.py
from gpt_model import GPT, GPTConfig  # noqa: E402


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (tests: 1)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=128)
    model = GPT(config)
    full_params = sum(p.numel() for p in model.parameters())
    unsharded_bytes = 4 * full_params * 4  # fp32 parameters + gradients + AdamW exp_avg, exp_avg_sq

    z3.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step_model = torch.compile(model, backend="zero3", options={"codegen": args.codegen})

    # a learnable stream: each token is the previous one plus one
    gen = torch.Generator().manual_seed(rank)
    start = torch.randint(0, config.vocab_size, (8, 1), generator=gen)
    tokens = (start + torch.arange(config.block_size + 1)) % config.vocab_size
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    if rank == 0:
        print(f"GPT {full_params / 1e6:.2f}M parameters, {world} ranks, codegen={args.codegen}")
    with z3.record_graphs() as graphs:
        for step in range(args.steps):
            begin = time.perf_counter()
            logits = step_model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            loss.backward()
            if step == 0:
                grad_bytes = local_bytes(p.grad for p in model.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            elapsed = time.perf_counter() - begin
            if rank == 0:
                note = " (includes compilation)" if step == 0 else ""
                print(
                    f"step {step}: loss {global_loss.item() / world:.4f}  {elapsed * 1e3:8.1f} ms{note}"
                )

    state_bytes = local_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step")
    persistent = local_bytes(model.parameters()) + grad_bytes + state_bytes
    for r in range(world):
        if r == rank:
            print(
                f"rank {rank}: parameters+gradients+AdamW state {persistent / 2**20:.2f} MiB "
                f"vs {unsharded_bytes / 2**20:.2f} MiB unsharded ({persistent / unsharded_bytes:.3f}x)"
            )
        dist.barrier()
    if rank == 0:
        for record in graphs:
            signature = collective_signature(record.gm.graph)
            kinds = {}
            for kind, _, group_size, numel, dtype in signature:
                size = torch.empty(0, dtype=getattr(torch, dtype.split(".")[1])).element_size()
                full = numel * group_size if kind == "all_gather" else numel  # unsharded bytes
                count, nbytes = kinds.get(kind, (0, 0))
                kinds[kind] = (count + 1, nbytes + full * size)
            summary = ", ".join(f"{n} {k} of {b / 2**20:.2f} MiB" for k, (n, b) in kinds.items())
            print(f"{record.kind} graph: {summary or 'no collectives'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
