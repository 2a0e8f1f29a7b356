"""Model presets, a Llama-style model, synthetic data and the loss every contender trains on.

The GPT is the test suite's nanoGPT (tests/support/models.py, tied embeddings); the Llama-style model
(RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention, untied head) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.support.models import GPT, GPTConfig


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    block_size: int = 2048  # longest sequence the rotary tables cover
    n_layer: int = 16
    n_head: int = 32
    n_kv_head: int = 8
    n_embd: int = 2048
    ffn_hidden: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (block_size, head_dim / 2)."""
    head_dim = config.n_embd // config.n_head
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dimension of x (batch, heads, seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.wq = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeats = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config)
        # non-persistent buffers: every sharding scheme keeps them whole on each rank
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style initialisation (the test GPT's std 0.2 saturates the softmax at width 512+)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    config: GPTConfig | LlamaConfig
    per_rank_batch: int
    seq_len: int
    gpu_only: bool = False

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(  # one block: Inductor's per-kernel C++ builds dominate a 2-core run
            "quick",
            GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=4, n_embd=64),
            per_rank_batch=4,
            seq_len=64,
        ),
        ModelPreset(  # compile_time.py --depth: blocks of width 128, as many as asked
            "gpt-w128",
            GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128),
            per_rank_batch=4,
            seq_len=64,
        ),
        ModelPreset(  # ~25M parameters
            "gpt-small",
            GPTConfig(vocab_size=12288, block_size=256, n_layer=6, n_head=8, n_embd=512),
            per_rank_batch=4,
            seq_len=128,
        ),
        ModelPreset(  # GPT-2 small, ~124M parameters
            "gpt-medium",
            GPTConfig(vocab_size=50304, block_size=256, n_layer=12, n_head=12, n_embd=768),
            per_rank_batch=2,
            seq_len=256,
        ),
        ModelPreset(  # GPT-2 small at a GPU-sized batch (gpu.py)
            "gpt-medium-gpu",
            GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
            per_rank_batch=8,
            seq_len=1024,
            gpu_only=True,
        ),
        ModelPreset(  # ~1.1B parameters, Llama-3.2-1B-like shape with an untied head
            "llama-1b",
            LlamaConfig(),
            per_rank_batch=2,
            seq_len=1024,
            gpu_only=True,
        ),
        ModelPreset(  # a tiny Llama for smoke tests of the Llama code paths on CPU
            "llama-tiny",
            LlamaConfig(
                vocab_size=256,
                block_size=64,
                n_layer=2,
                n_head=4,
                n_kv_head=2,
                n_embd=64,
                ffn_hidden=128,
            ),
            per_rank_batch=4,
            seq_len=64,
        ),
    )
}


def build_model(preset: ModelPreset, seed: int, device: torch.device | str) -> nn.Module:
    """The preset's model, initialised from ``seed`` directly on ``device`` (same on every rank)."""
    torch.manual_seed(seed)
    with torch.device(device):
        if isinstance(preset.config, LlamaConfig):
            return Llama(preset.config)
        model = GPT(preset.config)
        init_weights(model)
        return model


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: the unit FSDP2 shards (and compiles) one by one."""
    return model.layers if isinstance(model, Llama) else model.transformer.h


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters count once


def global_batch(
    preset: ModelPreset, world: int, step: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch (world * per_rank_batch sequences), the same in every process.

    A learnable stream (each sequence counts up from a random token with a random stride), so the
    loss falls and a contender with wrong gradients visibly leaves the reference trajectory.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = world * preset.per_rank_batch
    start = torch.randint(0, preset.vocab_size, (rows, 1), generator=gen)
    stride = torch.randint(1, 4, (rows, 1), generator=gen)
    tokens = (start + stride * torch.arange(preset.seq_len + 1)) % preset.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def rank_slice(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return batch[0][rows], batch[1][rows]


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------- byte-level text
# compression.py and reduction_error.py train on real text: the bytes of a file Python ships.

TEXT_MODELS = {"gpt": "gpt-w128", "llama": "llama-tiny"}  # their name -> preset
TEXT_SEQ = 64


def text_corpus() -> torch.Tensor:
    """The bytes of ``pydoc_data/topics.py`` as token ids (vocab 256)."""
    import pydoc_data.topics as topics

    with open(topics.__file__, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()


def text_batch(data: torch.Tensor, rows: int, gen: torch.Generator):
    """``rows`` random windows of ``data``: (inputs, targets), each ``(rows, TEXT_SEQ)``."""
    starts = torch.randint(0, data.numel() - TEXT_SEQ - 1, (rows,), generator=gen)
    tokens = torch.stack([data[s : s + TEXT_SEQ + 1] for s in starts.tolist()])
    return tokens[:, :-1], tokens[:, 1:]
