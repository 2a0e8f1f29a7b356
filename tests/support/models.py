"""Small models for the tests: a GPT (tied embeddings, LayerNorm, biases, attention) and an MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 61
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 20  # not divisible by 3: uneven shards at world size 3
    bias: bool = True
    tie_embeddings: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embd = x.shape
        q, k, v = self.c_attn(x).split(embd, dim=2)
        q = q.view(batch, seq, self.n_head, embd // self.n_head).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, embd // self.n_head).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, embd // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(batch, seq, embd)
        return self.c_proj(y)


class MLPBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLPBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.2)
            if module.bias is not None:
                nn.init.normal_(module.bias, mean=0.0, std=0.1)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.2)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        pos = torch.arange(seq, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_batch(global_batch: int, config: GPTConfig = GPTConfig(), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (global_batch, config.block_size), generator=gen)
    targets = torch.randint(0, config.vocab_size, (global_batch, config.block_size), generator=gen)
    return idx, targets


class FrozenMLP(nn.Module):
    """Three linear layers; the first is frozen (requires_grad=False)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(10, 17), nn.Tanh(), nn.Linear(17, 13), nn.Tanh(), nn.Linear(13, 5)
        )
        for p in self.layers[0].parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    # the loss in fp32 whatever the compute dtype (torch 2.11's eager mse_loss backward rejects a
    # bf16 input with an fp32 target; type promotion computes in fp32 anyway)
    return F.mse_loss(model(x).float(), y)


def mlp_batch(global_batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(global_batch, 10, generator=gen), torch.randn(global_batch, 5, generator=gen)


class GraphBreakGPT(GPT):
    """The GPT with a dynamo graph break between its blocks (and eager code in between)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        pos = torch.arange(seq, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = block(x)
            if i == 0:
                x = _eager_scale(self.transformer.ln_f, x)  # a graph break
        return self.lm_head(self.transformer.ln_f(x))


@torch._dynamo.disable
def _eager_scale(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """Runs eagerly between two compiled graphs, and reads a sharded parameter there."""
    return x * norm.weight.mean()


class TwoOutputs(nn.Module):
    """Two outputs; the second block's parameters flow into the second only (so the backend
    gates them: their gradient may be absent when that output is unused)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 12)
        self.b = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.a(x))
        return h.square().mean(), self.b(h)


def two_outputs_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    first, second = model(x)
    return first + F.mse_loss(second.float(), y)
