"""Train a sharded model and its unsharded single-process twin side by side (used by the tests)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zero3_compile as z3
from zero3_compile.compiler.recording import record_graphs

from .graph_checks import analyze
from .models import (
    GPT,
    FrozenMLP,
    GraphBreakGPT,
    TwoOutputs,
    gpt_batch,
    gpt_loss,
    mlp_batch,
    mlp_loss,
    two_outputs_loss,
)

PER_RANK_BATCH = 2


def build(model_name: str):
    torch.manual_seed(1234)
    if model_name == "gpt":
        return GPT(), gpt_loss, gpt_batch
    if model_name == "gpt_graph_break":
        return GraphBreakGPT(), gpt_loss, gpt_batch
    if model_name == "mlp":
        return FrozenMLP(), mlp_loss, mlp_batch
    if model_name == "two_outputs":
        return TwoOutputs(), two_outputs_loss, mlp_batch
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


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of per-parameter optimizer state tensors (the scalar ``step`` counters excluded)."""
    return local_bytes(
        value
        for state in opt.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    )


def train_pair(
    rank: int,
    world_size: int,
    model_name: str,
    optimizer: str,
    options: dict[str, Any] | None,
    steps: int = 5,
    check_inference: bool = False,
    analyze_graphs: bool = False,
    profile_step: bool = False,
    clip_norm: float | None = None,
) -> dict[str, Any]:
    """Train zero3 (each rank its slice of the batch) and the reference (whole batch) in lockstep.

    ``options=None`` runs the sharded model eagerly (no torch.compile). Returns the full gradients
    after the first backward, both loss trajectories, the full parameters after ``steps``
    optimizer steps, and the per-rank bytes of parameters, gradients and optimizer state.
    """
    with contextlib.ExitStack() as stack:
        records = stack.enter_context(record_graphs()) if analyze_graphs else None
        out = _train_pair(
            rank,
            world_size,
            model_name,
            optimizer,
            options,
            steps,
            check_inference,
            profile_step,
            clip_norm,
        )
    if records is not None:
        out["graphs"] = analyze(records)
    return out


def _train_pair(
    rank,
    world_size,
    model_name,
    optimizer,
    options,
    steps,
    check_inference,
    profile_step,
    clip_norm,
):
    torch._dynamo.reset()  # each job compiles (and records) its own graphs
    model, loss_fn, make_batch = build(model_name)
    reference = copy.deepcopy(model)
    z3.shard(model)
    step_model = (
        model if options is None else torch.compile(model, backend="zero3", options=options)
    )
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    ref_opt = make_optimizer(optimizer, [p for p in reference.parameters() if p.requires_grad])
    names = [n for n, _ in reference.named_parameters()]
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for step in range(steps):
        inputs, targets = make_batch(world_size * PER_RANK_BATCH, seed=0)  # fixed: loss must fall
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        loss = loss_fn(step_model, (inputs[mine], targets[mine]))
        loss.backward()
        ref_loss = loss_fn(reference, (inputs, targets))
        ref_loss.backward()
        if clip_norm is not None:  # torch's own clipping, on DTensor gradients
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm)
            out.setdefault("norms", []).append((norm.full_tensor().item(), ref_norm.item()))
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
            out["bytes"] = {
                "params": local_bytes(model.parameters()),
                "grads": local_bytes(p.grad for p in model.parameters()),
                "ref_params": local_bytes(reference.parameters()),
                "ref_grads": local_bytes(p.grad for p in reference.parameters()),
            }
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:
            out["bytes"]["optim"] = optimizer_state_bytes(opt)
            out["bytes"]["ref_optim"] = optimizer_state_bytes(ref_opt)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        out["losses"].append(global_loss.item() / world_size)
        out["ref_losses"].append(ref_loss.item())
    out["params"] = z3.full_state_dict(model)
    out["ref_params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    if profile_step:
        # one more forward + backward under the profiler: the collectives gloo really ran
        from torch.profiler import ProfilerActivity, profile

        inputs, targets = make_batch(world_size * PER_RANK_BATCH, seed=0)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss_fn(step_model, (inputs[mine], targets[mine])).backward()
        opt.zero_grad()
        names = [e.name for e in prof.events()]
        out["profiled"] = {
            name: names.count(name) for name in set(names) if name.startswith("gloo:")
        }
    if check_inference:
        inputs, _ = make_batch(world_size * PER_RANK_BATCH, seed=99)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        model.eval()
        reference.eval()
        with torch.no_grad():
            out["inference"] = step_model(inputs[mine])
            out["ref_inference"] = reference(inputs[mine])
    return out


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict[str, Any]:
    """Run several ``train_pair`` jobs in one process group; keyed by "model/optimizer/tag"."""
    results = {}
    for model_name, optimizer, options, tag, kwargs in jobs:
        results[f"{model_name}/{optimizer}/{tag}"] = train_pair(
            rank, world_size, model_name, optimizer, options, **kwargs
        )
    return results


def full_optimizer_state(model, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as a full tensor, keyed ``<parameter name>.<state key>``."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
        for p, state in opt.state.items()
        for k, v in state.items()
    }
