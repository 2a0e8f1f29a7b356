"""A small Llama for tensor parallelism (separate q/k/v projections, heads from the local width),
its pipeline stages, and the tensor-parallel plans torchtitan applies to it (with and without
sequence parallelism)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 64
    seq: int = 8
    dim: int = 16
    n_heads: int = 4
    hidden: int = 24
    n_layers: int = 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden, bias=False)
        self.w2 = nn.Linear(config.hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: TinyLlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, config: TinyLlamaConfig = TinyLlamaConfig()):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if not name.endswith("norm.weight"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
                else:
                    param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class Part(nn.Module):
    """A slice of TinyLlama: its embedding, some blocks, its head (each optional), under the
    whole model's parameter names (blocks keyed by their index, as torchtitan cuts stages)."""

    def __init__(self, model: TinyLlama, embed: bool, layers: list[int], head: bool):
        super().__init__()
        self.tok_embeddings = copy.deepcopy(model.tok_embeddings) if embed else None
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(model.layers[i]) for i in layers})
        self.norm = copy.deepcopy(model.norm) if head else None
        self.output = copy.deepcopy(model.output) if head else None

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


# stage index -> (embed, layers, head); 2 stages (one per pp rank) or 4 (two per pp rank)
SPLITS = {
    2: [(True, [0], False), (False, [1], True)],
    4: [(True, [], False), (False, [0], False), (False, [1], False), (False, [], True)],
}


def llama_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    if hasattr(logits, "full_tensor"):  # a loss-parallel plan would keep it sharded
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def llama_batch(global_batch: int, config: TinyLlamaConfig = TinyLlamaConfig(), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (global_batch, config.seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (global_batch, config.seq), generator=gen)
    return tokens, targets


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> nn.Module:
    """torchtitan's Llama plan: colwise q/k/v/w1/w3, rowwise wo/w2; with sequence parallelism
    the norms run on sequence shards and the residual stream stays ``Shard(1)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    # a pipeline stage (Part) may lack the embedding or the head
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in layers:
        plan = {
            "attention": PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    return model
