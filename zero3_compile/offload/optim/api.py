"""``offload_optimizer``: an optimizer whose state lives in an offload store between steps.

```python
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), tier="disk", path=p)
```
The optimizer object stays the same; its ``step``, ``state_dict`` and ``load_state_dict`` go
through its ``OptimizerOffload`` (``tiled.py``; with ``in_backward=True`` its steps are taken
during the backward: ``in_backward.py``).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from ...sharding.state import state_of
from ..grads import take_gradients
from ..params import keep_reloads
from ..store import DiskStore, HostStore
from .in_backward import InBackward, check_setup
from .tiled import OptimizerOffload


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    tier: str = "disk",
    path: str | None = None,
    *,
    tile_mb: float = 64.0,
    read_ahead: int = 1,
    threads: int = 4,
    o_direct: bool = False,
    poison: bool = False,
    double_buffer: bool = True,
    in_backward: bool = False,
) -> torch.optim.Optimizer:
    """Keep ``optimizer``'s state in ``tier`` ("disk" or, for accelerator models, "cpu") between
    steps; returns the same optimizer object (``isinstance`` checks and DCP keep working).

    ``double_buffer=False``: one copy of the state on disk, rewritten in place (half the disk);
    a step that fails on an I/O error then loses the state it was writing (reads of it raise:
    resume from a checkpoint) instead of keeping the previous one.

    ``in_backward=True``: each parameter steps during the backward, as soon as its gradient is
    reduced, so the state's I/O runs beside the backward's compute; ``step()`` waits for the
    last steps and commits. Needs ``Offload(params=..., grads=...)`` and an elementwise
    optimizer; refuses gradient clipping, scaling and accumulation (``in_backward.py``).

    Example:
        ```python
        opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), tier="disk", path="/nvme/run1")
        loss_fn(step_model(x)).backward()
        opt.step()  # the state streams through in tiles
        ```
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"zero3: offload_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "zero3: offload_optimizer needs an optimizer whose state is per parameter; LBFGS "
            "keeps a history across all parameters and re-evaluates a closure"
        )
    if tier not in ("disk", "cpu"):
        raise ValueError(f"zero3: offload_optimizer(tier={tier!r}) must be 'disk' or 'cpu'")
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if tier == "cpu" and devices <= {"cpu"}:
        raise ValueError(
            "zero3: offload_optimizer(tier='cpu') keeps state in host memory for accelerator "
            "models; this optimizer's parameters already live in host memory. Use tier='disk'."
        )
    if not (isinstance(read_ahead, int) and read_ahead >= 0):
        raise ValueError(f"zero3: read_ahead must be an int >= 0, got {read_ahead!r}")
    if getattr(optimizer, "_zero3_tiled", False):
        raise ValueError("zero3: this optimizer is offloaded already")
    rank = dist.get_rank() if dist.is_initialized() else 0
    store = (
        HostStore()
        if tier == "cpu"
        else DiskStore(
            path, "optimizer", rank, threads=threads, o_direct=o_direct, double_buffer=double_buffer
        )
    )
    if in_backward:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        check_setup(optimizer, {p: state_of(p) for p in params})
    offloaded = OptimizerOffload(optimizer, store, int(tile_mb * 2**20), read_ahead, poison)
    if in_backward:
        offloaded.in_backward = InBackward(offloaded)
        for param in params:
            # a tied parameter's gradient comes in parts (one per use, eager or across graphs):
            # it is spooled, and steps in step()
            if not state_of(param).tied:
                take_gradients(state_of(param), offloaded.in_backward.take)
                keep_reloads(state_of(param), offloaded.in_backward.keep)
    optimizer.__dict__["_zero3_tiled"] = True
    optimizer.__dict__["_zero3_offload"] = offloaded
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.state_dict = types.MethodType(_state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(_load_state_dict, optimizer)
    if any(optimizer.state.values()):  # state that exists already goes to the store now
        offloaded.store_all()
        offloaded.mark_states()
    return optimizer


def _step(self, closure=None):
    if closure is not None:
        raise ValueError(
            "zero3: an offloaded optimizer steps in tiles and cannot re-evaluate a closure; "
            "compute the loss and call backward() before step()"
        )
    offloaded = self._zero3_offload
    try:
        if offloaded.in_backward is not None:
            return offloaded.in_backward.step()
        return offloaded.step()
    finally:
        offloaded.mark_states()


def _state_dict(self):
    return self._zero3_offload.state_dict()


def _load_state_dict(self, state_dict):
    try:
        return self._zero3_offload.load_state_dict(state_dict)
    finally:
        self._zero3_offload.mark_states()


__all__ = ["offload_optimizer"]
