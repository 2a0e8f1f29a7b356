"""``z3.gathered(model)``: every parameter gathered once, for inference (``generate``).

```python
with z3.gathered(model):
    tokens = model.generate(**inputs, max_new_tokens=64)   # no collective per token
```
Each parameter is all-gathered once on entry (in its compute dtype, in module order: the same
collectives on every rank) and read from there until the block ends; then the full copies are
freed and the shards are what the model reads again. Inside the block the model runs no
collective, so ranks may run different prompts, of different lengths, for different numbers of
steps. In-place writes to a parameter inside the block reach its shard (the eager
write-through); the copies carry no gradient, so training inside the block fails at
``backward()`` instead of silently skipping the update. Memory: the whole model per rank while
the block lasts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from ..collectives.ops import UNSHARD
from ..sharding.state import ShardState
from .loading import resting_states


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Gather every sharded parameter of ``model`` once; restore the shards on exit. Every rank
    of the model's mesh must enter it (the gathers are collective); inside, none has to."""
    states = resting_states(
        model, "z3.gathered()", "turn gradient sync back on first; gathered() does not nest"
    )
    done = []
    try:
        with torch.no_grad():
            for state in states:
                with state.root.active():
                    full = UNSHARD(state.local(), state.param_id, state.spec.literal(), None)
                state.kept_full = full
                state.transition(ShardState.GATHERED)
                done.append(state)
        yield model
    finally:
        for state in done:
            _write_back_if_changed(state)
            state.kept_full = None
            state.transition(ShardState.SHARDED)


@torch.no_grad()
def _write_back_if_changed(state) -> None:
    """This rank's rows of the full copy into the shard, if the block changed them."""
    from ..offload.params import loaded

    rows = state.spec.local_view(state.kept_full, state.rank)
    offloaded = [state] if state.offload is not None else []
    with loaded(offloaded, write_back=False):
        local = state.local()
        if torch.equal(rows, local.to(rows.dtype)):
            return
    with loaded(offloaded, write_back=True):
        state.local().copy_(rows.to(state.local().dtype))
