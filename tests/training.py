"""Train a sharded model and its unsharded single-process twin side by side (used by the tests)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import zero3_compile as z3

from .models import GPT, FrozenMLP, gpt_batch, gpt_loss, mlp_batch, mlp_loss

PER_RANK_BATCH = 2


def build(model_name: str):
    torch.manual_seed(1234)
    if model_name == "gpt":
        return GPT(), gpt_loss, gpt_batch
    if model_name == "mlp":
        return FrozenMLP(), mlp_loss, mlp_batch
    raise ValueError(model_name)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error of a tensor as a whole."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def train_pair(
    rank: int,
    world_size: int,
    model_name: str,
    optimizer: str,
    options: dict[str, Any],
    steps: int = 5,
    compile_model: bool = True,
) -> dict[str, Any]:
    """Train zero3 (each rank its slice of the batch) and the reference (whole batch) in lockstep.

    Returns the full gradients after the first backward, both loss trajectories and the full
    parameters after ``steps`` optimizer steps, for both, on every rank.
    """
    model, loss_fn, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    z3.shard(model)
    step_model = torch.compile(model, backend="zero3", options=options) if compile_model else model
    opt = make_optimizer(optimizer, model.parameters())
    ref_opt = make_optimizer(optimizer, [p for p in reference.parameters() if p.requires_grad])
    names = [n for n, _ in reference.named_parameters()]
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for step in range(steps):
        inputs, targets = make_batch(world_size * PER_RANK_BATCH, seed=step)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        loss = loss_fn(step_model, (inputs[mine], targets[mine]))
        loss.backward()
        ref_loss = loss_fn(reference, (inputs, targets))
        ref_loss.backward()
        if step == 0:
            params = dict(model.named_parameters())
            out["grads"] = {
                n: (params[n].grad.full_tensor() if params[n].grad is not None else None)
                for n in names
            }
            out["ref_grads"] = {
                n: p.grad.clone() if p.grad is not None else None
                for n, p in reference.named_parameters()
            }
            out["grad_types"] = {n: type(params[n].grad).__name__ for n in names}
            out["grad_placements"] = {
                n: str(params[n].grad.placements) for n in names if params[n].grad is not None
            }
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        out["losses"].append(global_loss.item() / world_size)
        out["ref_losses"].append(ref_loss.item())
    out["params"] = z3.full_state_dict(model)
    out["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    return out
