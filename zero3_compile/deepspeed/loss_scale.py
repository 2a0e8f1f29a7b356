"""A static loss scale for fp16 training: DeepSpeed's ``"fp16": {"enabled": true, "loss_scale": N}``.

DeepSpeed multiplies the loss by ``N`` before the backward, divides the gradients by ``N`` before
the step, and skips a step whose gradients hold an inf or NaN (keeping ``N``: a static scale never
changes). ``LossScaler`` does the same for a zero3 model with any ``torch.optim`` optimizer. The
overflow check covers every rank's gradient rows: the ranks agree (one all-reduce per mesh) and
skip the same steps, where each rank looking at its own shards alone would let the ranks'
parameters drift apart.

```python
scaler = LossScaler(1024.0)
for batch in loader:
    scaler.scale(loss_fn(step_model(batch))).backward()
    scaler.unscale_(opt)                      # optional: before clip_grad_norm_
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)                          # skipped (returns None) on inf/NaN gradients
    scaler.update()
    opt.zero_grad()
```
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..frontend.broadcast import all_reduce_mesh, mesh_device
from ..sharding.state import state_of

log = logging.getLogger(__name__)


class LossScaler:
    """A static loss scale (the same calls as ``torch.amp.GradScaler``; the scale never changes).

    loss_scale: the factor, > 0 (DeepSpeed's ``fp16.loss_scale``; its 0, a dynamic scale, is
        not this class).

    Example:
        ```python
        scaler = LossScaler(1024.0)  # or LossScaler.from_config(ds_config)
        scaler.scale(loss).backward()
        scaler.step(opt)  # None: skipped on inf/NaN gradients of any rank
        scaler.update()
        ```
    """

    def __init__(self, loss_scale: float):
        if (
            not isinstance(loss_scale, (int, float))
            or isinstance(loss_scale, bool)
            or not math.isfinite(loss_scale)
            or loss_scale <= 0
        ):
            raise ValueError(
                f"zero3: LossScaler(loss_scale) takes a finite number > 0, got {loss_scale!r} "
                "(DeepSpeed's loss_scale 0 means a dynamic scale, which this static one is not)"
            )
        self.loss_scale = float(loss_scale)
        self.skipped_steps = 0
        self._found_inf: dict[int, bool] = {}  # id(optimizer) -> unscaled, with inf/NaN?

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaler | None:
        """The scaler of a DeepSpeed config's ``"fp16"`` section; None when fp16 is off."""
        fp16 = config.get("fp16") or {}
        if not fp16.get("enabled", False):
            return None
        scale = fp16.get("loss_scale", 0)
        if not scale:
            raise ValueError(
                "zero3: fp16.loss_scale 0 (a dynamic loss scale) has no counterpart here; set a "
                "static loss_scale (e.g. 1024), or train in bf16, which needs none"
            )
        return cls(scale)

    def get_scale(self) -> float:
        return self.loss_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call ``.backward()`` on it."""
        return loss * self.loss_scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, once per step, and
        find whether any rank's hold an inf or NaN (collective over the parameters' meshes)."""
        if id(optimizer) in self._found_inf:
            raise RuntimeError(
                "zero3: LossScaler.unscale_() was already called for this optimizer since its "
                "last step(); call it once per step"
            )
        inverse = 1.0 / self.loss_scale
        found = torch.zeros((), dtype=torch.float32)
        meshes: dict[int, Any] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    state = state_of(param)
                    if state is not None:
                        meshes.setdefault(id(state.root.dp), state.root.dp)
                    grad.mul_(inverse)
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if not bool(torch.isfinite(local).all()):
                        found.fill_(1.0)
        for dp in meshes.values():  # in the order of the groups: the same on every rank
            flag = found.to(mesh_device(dp))
            all_reduce_mesh(flag, dp, dist.ReduceOp.MAX)
            found = flag.cpu()
        self._found_inf[id(optimizer)] = bool(found)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``optimizer.step()`` on unscaled gradients, or nothing (returns None) when they hold
        an inf or NaN on any rank: the step is skipped and ``skipped_steps`` counts it."""
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf.pop(id(optimizer)):
            self.skipped_steps += 1
            log.warning(
                "[rank %d] zero3: inf/NaN gradients at loss scale %g: step skipped (%d so far)",
                dist.get_rank() if dist.is_initialized() else 0,
                self.loss_scale,
                self.skipped_steps,
            )
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Nothing: a static scale stays (kept for ``GradScaler``'s loop)."""

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_scale = float(state["loss_scale"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
