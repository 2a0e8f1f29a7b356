"""DeepSpeed's optimizer and learning-rate schedules from a config's ``optimizer`` and
``scheduler`` sections, rebuilt on ``torch.optim``.

Hugging Face's schedules with the same names are not DeepSpeed's: DeepSpeed warms up
logarithmically by default (``warmup_type: "log"``), from ``warmup_min_lr``, over at least two
steps, one step later than ``transformers``' linear warmup, and its cosine ends at
``cos_min_ratio``. ``DeepSpeedSchedule`` reproduces DeepSpeed's values step by step (the tests
compare it with DeepSpeed's own classes), so a DeepSpeed config trains with the learning rates it
trained with.

```python
spec = ScheduleSpec("WarmupDecayLR", {"warmup_num_steps": 10, "total_num_steps": 100})
scheduler = spec.build(optimizer, total_steps=100, warmup_steps=0)   # "auto" values filled
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_SCHEDULE_KEYS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                 "last_batch_iteration"},
    "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "total_num_steps", "last_batch_iteration"},
    "WarmupCosineLR": {"warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "total_num_steps", "last_batch_iteration"},
}  # fmt: skip
_OPTIMIZER_KEYS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam",
                   "bias_correction", "amsgrad"}  # fmt: skip


def _given(params: dict, key: str) -> bool:
    return params.get(key, "auto") != "auto"


@dataclass(frozen=True)
class ScheduleSpec:
    """A DeepSpeed ``scheduler`` section, checked; ``build`` makes the torch scheduler."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, section: dict) -> ScheduleSpec:
        kind = section.get("type", "")
        if kind not in SCHEDULES:
            raise ValueError(
                f"zero3: DeepSpeed scheduler type {kind!r} has no counterpart here (known: "
                f"{', '.join(SCHEDULES)}); build the schedule in torch and drop the config's "
                '"scheduler" section'
            )
        params = dict(section.get("params") or {})
        unknown = sorted(set(params) - _SCHEDULE_KEYS[kind])
        if unknown:
            raise ValueError(
                f"zero3: DeepSpeed {kind} params {unknown} are not DeepSpeed's; known: "
                f"{sorted(_SCHEDULE_KEYS[kind])}"
            )
        if params.get("last_batch_iteration", -1) not in (-1, "auto"):
            raise ValueError(
                "zero3: scheduler.params.last_batch_iteration: resume the schedule from a "
                "checkpoint (its state is saved with it) instead of setting it here"
            )
        kind_of_warmup = params.get("warmup_type", "log")
        if kind_of_warmup not in ("log", "linear", "auto"):
            raise ValueError(
                f"zero3: scheduler.params.warmup_type={kind_of_warmup!r} must be 'log' or 'linear'"
            )
        return cls(kind, params)

    def build(
        self, optimizer: torch.optim.Optimizer, total_steps: int | None, warmup_steps: int | None
    ) -> DeepSpeedSchedule:
        """The scheduler, with ``"auto"`` values taken as Hugging Face's DeepSpeed integration
        fills them: the optimizer's learning rate, ``total_steps``, ``warmup_steps``."""
        p = self.params
        warmup = int(p["warmup_num_steps"]) if _given(p, "warmup_num_steps") else None
        if warmup is None:
            warmup = 1000 if "warmup_num_steps" not in p or warmup_steps is None else warmup_steps
        total = None
        if self.kind != "WarmupLR":
            total = int(p["total_num_steps"]) if _given(p, "total_num_steps") else total_steps
            if total is None:
                raise ValueError(
                    f'zero3: {self.kind} needs total_num_steps (in the config or, for "auto", '
                    "from the trainer or DummyScheduler(total_num_steps=...))"
                )
        max_lr = p.get("warmup_max_lr", "auto" if self.kind == "WarmupLR" else 0.001)
        return DeepSpeedSchedule(
            optimizer,
            kind=self.kind,
            warmup_num_steps=max(warmup, 0),
            warmup_type=p.get("warmup_type", "log") if _given(p, "warmup_type") else "log",
            total_num_steps=total,
            min_lr=float(p["warmup_min_lr"]) if _given(p, "warmup_min_lr") else 0.0,
            max_lr=None if max_lr == "auto" else float(max_lr),
            warmup_min_ratio=float(p.get("warmup_min_ratio", 0.0)),
            cos_min_ratio=float(p.get("cos_min_ratio", 0.0001)),
        )


class DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's ``WarmupLR`` / ``WarmupDecayLR`` / ``WarmupCosineLR`` as a torch scheduler.

    DeepSpeed counts its iteration from -1 (the value before the first ``step()``); torch's
    ``last_epoch`` counts from 0 at construction, so iteration = ``last_epoch - 1``.
    ``max_lr=None``: each group's learning rate when the scheduler is built.
    """

    def __init__(self, optimizer, *, kind: str, warmup_num_steps: int, warmup_type: str,
                 total_num_steps: int | None, min_lr: float, max_lr: float | None,
                 warmup_min_ratio: float, cos_min_ratio: float):  # fmt: skip
        self.kind = kind
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        self.min_lr = min_lr
        self.max_lrs = [max_lr if max_lr is not None else g["lr"] for g in optimizer.param_groups]
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        step = self.last_epoch - 1
        if self.kind == "WarmupCosineLR":
            return [base * self._cosine_ratio(step) for base in self.base_lrs]
        if step < 0:
            return [self.min_lr for _ in self.max_lrs]
        gamma = self._warmup(step) if step < self.warmup_num_steps else self._after(step)
        return [self.min_lr + (top - self.min_lr) * gamma for top in self.max_lrs]

    def _warmup(self, step: int) -> float:
        if self.warmup_type == "log":
            return math.log(step + 1) / math.log(self.warmup_num_steps)
        return step / self.warmup_num_steps

    def _after(self, step: int) -> float:
        if self.kind == "WarmupLR":
            return 1.0
        span = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / span)

    def _cosine_ratio(self, step: int) -> float:
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup(step) * (1.0 - self.warmup_min_ratio)
        progress = (step - self.warmup_num_steps + 1) / max(
            1, self.total_num_steps - self.warmup_num_steps
        )
        cosine = (1 + math.cos(math.pi * min(1.0, progress))) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


@dataclass(frozen=True)
class OptimizerSpec:
    """A DeepSpeed ``optimizer`` section (Adam or AdamW), checked; ``build`` makes the torch
    optimizer DeepSpeed would run (its ``Adam`` is AdamW unless ``adam_w_mode`` is false)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, section: dict) -> OptimizerSpec:
        kind = section.get("type", "")
        if str(kind).lower() not in ("adam", "adamw"):
            raise ValueError(
                f"zero3: DeepSpeed optimizer type {kind!r}: only Adam and AdamW are translated; "
                "build another optimizer in torch (or TrainingArguments(optim=...)) and drop the "
                'config\'s "optimizer" section'
            )
        params = dict(section.get("params") or {})
        unknown = sorted(set(params) - _OPTIMIZER_KEYS)
        if unknown:
            raise ValueError(
                f"zero3: DeepSpeed Adam params {unknown} are not translated; known: "
                f"{sorted(_OPTIMIZER_KEYS)}"
            )
        if params.get("adam_w_mode", True) is False:
            raise ValueError(
                "zero3: optimizer.params.adam_w_mode=false (Adam with L2 weight decay) is not "
                "translated; build torch.optim.Adam yourself and drop the config's optimizer"
            )
        if params.get("bias_correction", True) is False or params.get("amsgrad", False) is True:
            raise ValueError(
                "zero3: optimizer.params bias_correction=false / amsgrad=true change Adam's "
                "update and are not translated; build the optimizer in torch instead"
            )
        return cls(str(kind), params)

    def build(self, parameters, lr: float | None = None, weight_decay: float | None = None):
        """``torch.optim.AdamW`` over ``parameters``; ``"auto"`` values from ``lr`` and
        ``weight_decay`` (``accelerate.utils.DummyOptim``'s), else torch's defaults."""
        p = self.params
        kwargs: dict[str, Any] = {}
        lr = float(p["lr"]) if _given(p, "lr") else lr
        if lr is not None:
            kwargs["lr"] = lr
        decay = float(p["weight_decay"]) if _given(p, "weight_decay") else weight_decay
        kwargs["weight_decay"] = 0.0 if decay is None else decay  # DeepSpeed's default
        if _given(p, "betas"):
            kwargs["betas"] = tuple(float(b) for b in p["betas"])
        if _given(p, "eps"):
            kwargs["eps"] = float(p["eps"])
        return torch.optim.AdamW(parameters, **kwargs)
