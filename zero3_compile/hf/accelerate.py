"""``z3hf.prepare``: your own training loop under ``accelerate launch``, with a zero3 model.

```python
accelerator = Accelerator()
model = z3hf.from_pretrained(AutoModelForCausalLM, path)          # or z3.shard(model)
model, opt, dl, sched = z3hf.prepare(accelerator, model, opt, dl, sched)
for batch in dl:
    with z3hf.accumulate(accelerator, model):                   # optional accumulation
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad()
```
``accelerator.prepare`` would wrap a model in DDP (refused for DTensor parameters on GPUs, a
``broadcast`` error on CPU); ``prepare`` hands accelerate everything but the model, and returns
the model compiled with the zero3 backend. Accelerate's own mixed precision is refused: give the
model a ``MixedPrecision`` (``z3hf.from_pretrained(..., mp_policy=...)``) instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..frontend.accumulation import set_requires_gradient_sync
from ..frontend.module import Zero3Module
from ..frontend.shard import shard
from .generation import mark_sharded


def prepare(accelerator, model: nn.Module, *objects, zero3_options: dict[str, Any] | None = None,
            compile: bool = True):  # fmt: skip
    """``(compiled model, *accelerator.prepare(objects))``; shards ``model`` first if needed."""
    if str(getattr(accelerator, "mixed_precision", "no")) not in ("no", "None"):
        raise ValueError(
            f"zero3: Accelerator(mixed_precision={accelerator.mixed_precision!r}) would autocast "
            "around the sharded model; leave it 'no' and give the model a z3.MixedPrecision "
            "(z3hf.from_pretrained(..., mp_policy=z3.MixedPrecision(torch.bfloat16, "
            "torch.float32)))"
        )
    if not isinstance(model, Zero3Module):
        model = shard(model.to(accelerator.device))
    mark_sharded(model)
    compiled = (
        torch.compile(model, backend="zero3", options=zero3_options or {}) if compile else model
    )
    prepared = accelerator.prepare(*objects) if objects else ()
    if len(objects) == 1:
        prepared = (prepared,)
    return (compiled, *prepared)


@contextlib.contextmanager
def accumulate(accelerator, model: nn.Module) -> Iterator[None]:
    """``accelerator.accumulate(model)`` for a zero3 model: gradients are reduce-scattered only
    on the micro-batch where accelerate syncs (its own ``no_sync`` does nothing for a model it
    did not wrap)."""
    base = getattr(model, "_orig_mod", model)
    with accelerator.accumulate(base):
        sync = bool(accelerator.sync_gradients)
        set_requires_gradient_sync(base, sync)
        yield
