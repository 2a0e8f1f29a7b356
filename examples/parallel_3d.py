"""3-D parallel training: pipeline x zero3 data parallel x tensor parallel (+ sequence parallel).

    torchrun --standalone --nproc-per-node 8 examples/parallel_3d.py      # pp 2 x dp 2 x tp 2
    torchrun --standalone --nproc-per-node 4 examples/parallel_3d.py      # pp 2 x dp 1 x tp 2

A small Llama is cut into two pipeline stages; each stage is tensor-parallel with torch's
``parallelize_module`` (torchtitan's plan), sharded by zero3 over its data-parallel group,
compiled with the zero3 backend and run by torch's 1F1B schedule through
``zero3_compile.parallel.PipelineStage``. Every rank also trains the whole model unsharded in
one process on the whole batch and prints how far the two are apart after each step.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import zero3_compile as z3
from zero3_compile.parallel import PipelineStage, clip_grad_norm_

VOCAB, SEQ, DIM, HEADS, HIDDEN, LAYERS = 128, 16, 64, 4, 128, 4
MICRO_BATCHES, BATCH_PER_DP_RANK, STEPS = 4, 8, 3
MAX_NORM = 0.5  # below the gradients' norm: every step clips


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def attention(self, x):
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stage(nn.Module):
    """Blocks ``first..last`` of the model, with the embedding on the first stage and the head on
    the last."""

    def __init__(self, model, first, last):
        super().__init__()
        self.embed = copy.deepcopy(model.embed) if first == 0 else None
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[first:last]))
        self.norm = copy.deepcopy(model.norm) if last == LAYERS else None
        self.head = copy.deepcopy(model.head) if last == LAYERS else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))


class Llama(Stage):
    def __init__(self):
        nn.Module.__init__(self)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)


def tensor_parallel(stage: Stage, tp_mesh) -> None:
    """torchtitan's plan: sequence parallel norms, colwise in-projections, rowwise out-projections."""
    if stage.embed is not None:
        parallelize_module(
            stage.embed,
            tp_mesh,
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        )
    if stage.head is not None:
        parallelize_module(
            stage,
            tp_mesh,
            {
                "norm": SequenceParallel(),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
    for block in stage.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "wq": ColwiseParallel(input_layouts=Shard(1)),
                "wk": ColwiseParallel(input_layouts=Shard(1)),
                "wv": ColwiseParallel(input_layouts=Shard(1)),
                "wo": RowwiseParallel(output_layouts=Shard(1)),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w3": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


PP, TP = 2, 2  # the data-parallel degree is what the world size leaves: world // (PP * TP)


def check_world_size() -> None:
    """Stop before any process group starts unless the ranks fill (pp 2, dp, tp 2)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (PP * TP) == 0:
        return
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"parallel_3d.py needs a multiple of {PP * TP} ranks (pipeline {PP} x tensor {TP} x "
            f"data-parallel dp), got {world}. Run it as\n"
            "    torchrun --standalone --nproc-per-node 4 examples/parallel_3d.py   # dp 1\n"
            "    torchrun --standalone --nproc-per-node 8 examples/parallel_3d.py   # dp 2",
            file=sys.stderr,
            flush=True,
        )
    sys.exit(2)


def main() -> None:
    check_world_size()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    pp, tp = PP, TP
    dp = world // (pp * tp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    torch.manual_seed(0)
    reference = Llama()  # the same on every rank: the unsharded model, trained in one process
    half = LAYERS // 2
    stage_module = Stage(reference, 0, half) if pp_rank == 0 else Stage(reference, half, LAYERS)
    tensor_parallel(stage_module, mesh["tp"])
    z3.shard(stage_module, mesh=mesh["dp"])
    compiled = torch.compile(stage_module, backend="zero3", options={"codegen": "eager"})
    stage = PipelineStage(compiled, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=loss_fn)

    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    offset = 0 if pp_rank == 0 else half
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (dp * BATCH_PER_DP_RANK, SEQ), generator=gen)
        targets = torch.randint(0, VOCAB, (dp * BATCH_PER_DP_RANK, SEQ), generator=gen)
        rows = slice(dp_rank * BATCH_PER_DP_RANK, (dp_rank + 1) * BATCH_PER_DP_RANK)
        if pp_rank == 0:
            schedule.step(tokens[rows])
        else:
            schedule.step(target=targets[rows])
        # the norm of both stages' gradients: torch's clip_grad_norm_ would see one stage's
        norm = clip_grad_norm_(stage_module.parameters(), MAX_NORM, pp_group=mesh["pp"].get_group())
        opt.step()
        opt.zero_grad()
        loss = loss_fn(reference(tokens), targets)
        loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        apart = 0.0
        for name, param in stage_module.named_parameters():
            if name.startswith("blocks."):
                index, rest = name.split(".", 2)[1:]
                name = f"blocks.{int(index) + offset}.{rest}"
            apart = max(
                apart, float((param.detach().full_tensor() - ref_params[name].detach()).abs().max())
            )
        if dp_rank == 0 and mesh["tp"].get_local_rank() == 0:
            print(
                f"step {step}: stage {pp_rank}, eager loss {loss.item():.4f}, grad norm "
                f"{norm.item():.6f} (eager {ref_norm.item():.6f}), max |param - eager| {apart:.2e}",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
