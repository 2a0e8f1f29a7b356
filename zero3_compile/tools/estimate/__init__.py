"""How much memory a model's training state takes per rank: ZeRO-3, with offload, and plain DDP.

```python
report = z3.estimate_memory(model, world_size=4, optimizer="adamw")   # model may be on "meta"
print(report)
```
or ``python -m zero3_compile.estimate --model llama-7b --world 4``.

Counted per rank: parameters (the fp32 master shards; ``param_dtype`` only changes the
transient gathered copies), gradients (same dtype as the parameters), optimizer state (per
parameter: 2 tensors for Adam/AdamW, 1 for SGD with momentum / Adagrad / RMSprop). "Resident"
is what stays in device memory between uses: offloaded tensors live in the tier instead (only
one tile of optimizer state is resident during ``step()``). Transient memory (gathered
parameters, activations, collective buffers) is the inspection report's business
(``zero3_compile.explain``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0, "adagrad": 1, "rmsprop": 1}


@dataclass
class MemoryRow:
    setting: str
    params: int
    grads: int
    optimizer: int
    offloaded: int  # bytes living in the offload tier instead of device memory

    @property
    def resident(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass
class MemoryEstimate:
    num_params: int
    world_size: int
    optimizer: str
    rows: list[MemoryRow] = field(default_factory=list)

    def row(self, setting: str) -> MemoryRow:
        return next(r for r in self.rows if r.setting == setting)

    def __str__(self) -> str:
        gib = 1e9
        lines = [
            f"{self.num_params / 1e9:.2f}B parameters, {self.world_size} ranks, "
            f"{self.optimizer} (per rank, GB = 1e9 bytes)",
            f"{'setting':<37} {'params':>9} {'grads':>9} {'optimizer':>10} {'resident':>9} "
            f"{'offloaded':>10}",
        ]
        for r in self.rows:
            lines.append(
                f"{r.setting:<37} {r.params / gib:9.2f} {r.grads / gib:9.2f} "
                f"{r.optimizer / gib:10.2f} {r.resident / gib:9.2f} {r.offloaded / gib:10.2f}"
            )
        return "\n".join(lines)


def estimate_memory(
    model: nn.Module,
    world_size: int,
    *,
    param_dtype: torch.dtype | None = None,
    offload=None,
    optimizer: str = "adamw",
    tile_mb: float = 64.0,
) -> MemoryEstimate:
    """Per-rank bytes of parameters, gradients and optimizer state for ``model`` (sharded or
    not, on any device including ``meta``) under plain data parallelism, ZeRO-3, and ZeRO-3
    with parameters and/or optimizer state offloaded. ``offload``: an ``Offload`` to add its
    row (the parameter rows are there anyway).

    Example:
        ```python
        with torch.device("meta"):
            model = Transformer(config)
        print(z3.estimate_memory(model, world_size=8, optimizer="adamw"))  # DDP, ZeRO-3, offload rows
        ```
    """
    key = optimizer.lower()
    if key not in _STATES:
        raise ValueError(f"zero3: optimizer={optimizer!r}; known: {', '.join(_STATES)}")
    states = _STATES[key]
    shapes, dtypes = [], []
    seen = set()
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        shapes.append(tuple(param.shape))
        dtypes.append(param.dtype)
    num_params = sum(math.prod(s) for s in shapes)
    full = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
    trainable = sum(
        math.prod(p.shape) * p.dtype.itemsize
        for p in {id(p): p for p in model.parameters()}.values()
        if p.requires_grad
    )
    shard = sum(
        math.ceil(s[0] / world_size) * math.prod(s[1:]) * d.itemsize if s else d.itemsize
        for s, d in zip(shapes, dtypes)
    )
    shard_trainable = shard * trainable // max(full, 1)
    optim_full, optim_shard = states * trainable, states * shard_trainable
    tile = min(optim_shard, int(tile_mb * 2**20))
    report = MemoryEstimate(num_params, world_size, optimizer)
    report.rows = [
        MemoryRow("data parallel (DDP)", full, trainable, optim_full, 0),
        MemoryRow("ZeRO-3", shard, shard_trainable, optim_shard, 0),
        MemoryRow("ZeRO-3, params offloaded", 0, shard_trainable, optim_shard, shard),
        MemoryRow("ZeRO-3, optimizer offloaded", shard, shard_trainable, 0, optim_shard),
        MemoryRow(
            "ZeRO-3, params + optimizer offloaded", 0, shard_trainable, 0, shard + optim_shard
        ),
        MemoryRow(
            "ZeRO-3, params + grads + optimizer offloaded",
            0,
            0,
            0,
            shard + shard_trainable + optim_shard,
        ),
    ]
    if tile:
        report.rows.append(
            MemoryRow(
                "  (during step(): one tile resident)",
                0,
                shard_trainable,
                tile,
                shard + optim_shard - tile,
            )
        )
    _ = param_dtype, offload  # shards and state keep the parameters' dtype; see docstring
    return report


# ----------------------------------------------------------------------------- presets


class _Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int, kv_hidden: int):
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_hidden, bias=False)
        self.v = nn.Linear(hidden, kv_hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.norm1 = nn.RMSNorm(hidden)
        self.norm2 = nn.RMSNorm(hidden)


class _Llama(nn.Module):
    """Llama's parameter shapes (no forward: for counting on the meta device)."""

    def __init__(self, vocab, hidden, layers, intermediate, heads, kv_heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        kv_hidden = hidden * kv_heads // heads
        self.layers = nn.ModuleList(
            [_Block(hidden, intermediate, kv_hidden) for _ in range(layers)]
        )
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)


PRESETS = {
    "llama-1b": dict(vocab=128256, hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8),
    "llama-7b": dict(
        vocab=32000, hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32
    ),
    "llama-13b": dict(
        vocab=32000, hidden=5120, layers=40, intermediate=13824, heads=40, kv_heads=40
    ),
    "llama-70b": dict(
        vocab=32000, hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8
    ),
}


def preset(name: str) -> nn.Module:
    with torch.device("meta"):
        return _Llama(**PRESETS[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero3_compile.estimate",
        description="Per-rank memory of a model's training state under ZeRO-3, offload and DDP.",
    )
    parser.add_argument("--model", choices=sorted(PRESETS), default="llama-7b")
    parser.add_argument("--world", type=int, default=4, help="number of ranks")
    parser.add_argument("--optimizer", choices=sorted(_STATES), default="adamw")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    model = preset(args.model).to(getattr(torch, args.dtype))
    report = estimate_memory(model, args.world, optimizer=args.optimizer)
    print(report)
    per_param = report.row("data parallel (DDP)").resident / report.num_params
    print(f"({per_param:.0f} bytes per parameter unsharded; ZeRO-3 divides them by {args.world})")
    return 0
