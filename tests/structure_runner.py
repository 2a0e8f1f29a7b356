"""Train a sharded model beside its single-process eager twin and report every difference.

``train_and_compare`` runs on each rank: the sharded model (compiled with the zero3 backend, or
eager) trains on the rank's share of each micro-batch, the unsharded reference on all shares
(the per-share losses averaged over ranks, as data parallelism averages gradients); losses,
gradients (``None`` exactly where eager has ``None``), the non-tensor parts of the outputs and
the final parameters are compared. The structure fuzzer (``structure_cases.py``) and the
regression tests (``test_structure_regressions.py``) both use it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import zero3_compile as z3

# relative error (max |a - b| / max |b|) allowed per tensor, by codegen (None: not compiled)
TOLERANCE = {None: 1e-5, "eager": 1e-5, "inductor": 1e-4}

# batch(step, micro, rank) -> (forward arguments, target)
Batch = Callable[[int, int, int], tuple[tuple, torch.Tensor]]


@dataclass(frozen=True)
class Training:
    """How to train: the backend's options (None: uncompiled), the optimizer, steps, micro-batches."""

    options: dict[str, Any] | None = None
    optimizer: str = "sgd"
    steps: int = 2
    micro_batches: int = 1
    keep_gathered: bool = False  # with micro_batches > 1: set_requires_gradient_sync's

    @property
    def codegen(self) -> str | None:
        return None if self.options is None else self.options.get("codegen", "inductor")


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        # eps large enough that a gradient of rounding noise (1e-9 here, 0 there) moves nothing
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / (scale if scale > 0 else 1.0)


def skeleton(out: Any) -> Any:
    """The output's structure with each tensor replaced by its shape (what must match exactly)."""
    if isinstance(out, torch.Tensor):
        return ("tensor", tuple(out.shape), out.dtype)
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, [skeleton(o) for o in out])
    if isinstance(out, dict):
        return ("dict", [(k, skeleton(v)) for k, v in out.items()])
    return out


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    grads = {}
    for name, param in model.named_parameters():  # same order on every rank: gathers pair up
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().clone()
    return grads


def _mean_over_ranks(value: float) -> float:
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_and_compare(
    rank: int,
    world: int,
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batch: Batch,
    training: Training,
    sync_timeout_s: float = 120.0,
) -> list[str]:
    """Train ``model`` sharded and a deep copy of it unsharded; returns the differences found
    (empty: equivalent). Exceptions propagate."""
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=sync_timeout_s)
    step_model = model
    if training.options is not None:
        step_model = torch.compile(model, backend="zero3", options=training.options)
    opt = make_optimizer(training.optimizer, model.parameters())
    ref_opt = make_optimizer(training.optimizer, reference.parameters())
    tol = TOLERANCE[training.codegen]
    micro_batches = training.micro_batches
    problems: list[str] = []
    for step in range(training.steps):
        loss_sum, ref_loss_sum = 0.0, 0.0
        for micro in range(micro_batches):
            if micro_batches > 1:
                sync = micro == micro_batches - 1
                keep = training.keep_gathered and not sync
                z3.set_requires_gradient_sync(model, sync, keep_gathered=keep)
            args, target = batch(step, micro, rank)
            out = step_model(*args)
            loss = loss_fn(out, target) / micro_batches
            loss.backward()
            loss_sum += loss.item()
            with torch.no_grad():
                ref_out = reference(*args)
            if skeleton(out) != skeleton(ref_out):
                problems.append(
                    f"step {step} micro {micro}: output {skeleton(out)} != eager {skeleton(ref_out)}"
                )
            for r in range(world):
                r_args, r_target = batch(step, micro, r)
                ref_loss = loss_fn(reference(*r_args), r_target) / (micro_batches * world)
                ref_loss.backward()
                ref_loss_sum += ref_loss.item()
        got_loss = _mean_over_ranks(loss_sum)
        if abs(got_loss - ref_loss_sum) > tol * max(abs(ref_loss_sum), 1e-3):
            problems.append(f"step {step}: loss {got_loss!r} != eager {ref_loss_sum!r}")
        grads, ref_grads = _full_grads(model), _full_grads(reference)
        for name, want in ref_grads.items():
            got = grads.get(name)
            if (got is None) != (want is None):
                state = lambda g: "None" if g is None else "a tensor"  # noqa: E731
                problems.append(f"step {step}: {name}.grad is {state(got)}, eager {state(want)}")
            elif want is not None and rel_diff(got, want) > tol:
                problems.append(f"step {step}: {name}.grad off by {rel_diff(got, want):.2e}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    params = z3.full_state_dict(model)
    for name, want in reference.state_dict().items():
        got = params.get(name)
        if got is None:
            problems.append(f"final state: {name} missing")
        elif rel_diff(got, want) > tol:
            problems.append(f"final state: {name} off by {rel_diff(got, want):.2e}")
    return problems
