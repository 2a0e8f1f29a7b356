"""Training patterns users of FSDP2 and DeepSpeed write, each run sharded on every rank and as
single-process eager training on the whole batch (the reference).

Each scenario returns plain data the tests compare: gradients (full) and ``grad is None`` flags
after each step, losses, parameters at the end, or the error every rank raised.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zero3_compile as z3
from zero3_compile.sharding.state import module_state, state_of

from .models import GPT, GPTConfig, gpt_batch


def compiled(model, codegen: str | None):
    if codegen is None:
        return model
    return torch.compile(model, backend="zero3", options={"codegen": codegen})


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name] = None if grad is None else grad.detach().clone()
    return out


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return {k: v.clone() for k, v in z3.full_state_dict(model).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_both(model, reference, step_fn, ref_step_fn, make_opt, steps: int = 3) -> dict[str, Any]:
    """``step_fn(step) -> loss`` on every rank (its share), ``ref_step_fn(step) -> loss`` on
    the whole batch; gradients compared after every step, parameters at the end."""
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    out: dict[str, Any] = {"grads": [], "ref_grads": [], "losses": [], "ref_losses": []}
    for step in range(steps):
        loss = step_fn(step)
        loss.backward()
        ref_loss = ref_step_fn(step)
        ref_loss.backward()
        out["grads"].append(grads_of(model))
        out["ref_grads"].append(grads_of(reference))
        out["losses"].append(mean_over_ranks(loss))
        out["ref_losses"].append(ref_loss.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["params"] = params_of(model)
    out["ref_params"] = params_of(reference)
    return out


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def error_message(error: BaseException) -> str:
    """The innermost zero3 error (dynamo wraps backend errors)."""
    seen = error
    while seen is not None:
        if type(seen).__module__.startswith("zero3_compile") or "zero3:" in str(seen):
            return f"{type(seen).__name__}: {seen}"
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------- 1. no-grad use first


class ReusedLayer(nn.Module):
    """A layer used twice per forward: first under no_grad (a detached target), then with grad
    (FSDP2's test_multi_forward_mixed_requires_grad, no-grad use first)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        with torch.no_grad():
            target = self.lin(x).tanh()
        y = self.lin(x)
        return F.mse_loss(y, target * 0.5) + self.head(y).square().mean()


def no_grad_first(rank, world, codegen):
    torch.manual_seed(0)
    model = ReusedLayer()
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    step = compiled(model, codegen)
    x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
    mine = x[4 * rank : 4 * rank + 4]
    return train_both(
        model,
        reference,
        lambda _: step(mine),
        lambda _: sum(reference(x[4 * r : 4 * r + 4]) for r in range(world)) / world,
        sgd,
    )


# --------------------------------------------------------------------- 2. unused outputs


class TwoHeads(nn.Module):
    """Returns two outputs; the loss uses only the first. ``extra`` is used by the second only."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.main = nn.Linear(6, 1)
        self.extra = nn.Linear(6, 3)

    def forward(self, x):
        h = self.trunk(x).relu()
        return self.main(h), self.extra(h)


def unused_output(rank, world, codegen):
    torch.manual_seed(0)
    model = TwoHeads()
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    step = compiled(model, codegen)
    x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(2))
    mine = x[4 * rank : 4 * rank + 4]
    return train_both(
        model,
        reference,
        lambda _: step(mine)[0].square().mean(),
        lambda _: (
            sum(reference(x[4 * r : 4 * r + 4])[0].square().mean() for r in range(world)) / world
        ),
        adamw,  # weight decay would move parameters that receive a zero gradient
    )


# --------------------------------------------------------------------- 3. writes after shard()


def _init_weights(module):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.3)
        nn.init.zeros_(module.bias)


def _edit(model):
    """What users do to parameters after wrapping."""
    torch.manual_seed(7)
    model.apply(_init_weights)  # re-initialisation
    model[2].reset_parameters()
    with torch.no_grad():
        model[0].weight.mul_(2)  # in-place update of the attribute
        model[0].weight[1].zero_()  # through a view
    model[0].bias.data.fill_(0.5)  # through .data
    nn.init.orthogonal_(model[2].weight)


def writes_after_shard(rank, world, codegen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    _edit(model)
    _edit(reference)
    out = {"after_edit": params_of(model), "ref_after_edit": params_of(reference)}
    step = compiled(model, codegen)
    x = torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(3))
    mine = x[2 * rank : 2 * rank + 2]
    out.update(
        train_both(
            model,
            reference,
            lambda _: step(mine).square().mean(),
            lambda _: (
                sum(reference(x[2 * r : 2 * r + 2]).square().mean() for r in range(world)) / world
            ),
            sgd,
        )
    )
    # an EMA-style update through the attributes, after training
    with torch.no_grad():
        for m, r in ((model[0], reference[0]), (model[2], reference[2])):
            m.weight.lerp_(torch.ones_like(m.weight), 0.1)
            r.weight.lerp_(torch.ones_like(r.weight), 0.1)
    out["after_ema"], out["ref_after_ema"] = params_of(model), params_of(reference)
    return out


class WritesInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)  # lost on a gathered copy: must be refused
        return self.lin(x)


def write_in_compiled_forward(rank, world, codegen):
    model = z3.shard(WritesInForward(), sync_timeout_s=120)
    try:
        compiled(model, codegen)(torch.randn(2, 4)).sum().backward()
    except Exception as error:  # noqa: BLE001
        return error_message(error)
    return "no error"


# --------------------------------------------------------------------- 4. mixture of experts


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoELayer(nn.Module):
    """Top-1 routing over 4 experts with the usual ``if idx.numel() == 0: continue`` loop.

    Routing is by the sign of the first two features, so the test chooses which experts each
    rank's tokens reach: expert 3 receives no token on any rank.
    """

    def __init__(self, name: str = "experts"):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.name = name
        setattr(self, name, nn.ModuleList([Expert() for _ in range(4)]))

    def forward(self, x):
        route = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()  # 0..3
        weight = self.gate(x).softmax(-1).gather(1, route[:, None])
        out = torch.zeros_like(x)
        for e, expert in enumerate(getattr(self, self.name)):
            idx = (route == e).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, weight[idx] * expert(x[idx]))
        return out


class MoENet(nn.Module):
    def __init__(self, name: str = "experts"):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = MoELayer(name)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        h = torch.cat([x[:, :2], h[:, 2:]], dim=1)  # routing follows the input's first features
        return self.out(self.moe(h)).square().mean()


def moe_batch(rank: int, step: int) -> torch.Tensor:
    """Rank 0's tokens go to experts 0 and 1, rank 1's to experts 1 and 2; none to expert 3."""
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(6, 8, generator=g)
    sign0 = torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0])  # expert 0 or 1 ...
    sign1 = torch.full((6,), -1.0) if rank == 0 else torch.tensor([-1.0, 1.0] * 3)
    if rank == 1:
        sign0 = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])  # ... expert 1 or 2
    x[:, 0] = x[:, 0].abs() * sign0
    x[:, 1] = x[:, 1].abs() * sign1
    return x


def moe(rank, world, codegen, name="experts", annotate=False):
    torch.manual_seed(0)
    model = MoENet(name)
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    if annotate:
        z3.set_leaf_modules(model, [MoELayer])
    step = compiled(model, codegen)
    try:
        return train_both(
            model,
            reference,
            lambda s: step(moe_batch(rank, s)),
            lambda s: sum(reference(moe_batch(r, s)) for r in range(world)) / world,
            sgd,
        )
    except Exception as error:  # noqa: BLE001
        return {"error": error_message(error)}


# --------------------------------------------------------------------- 5. per-rank lengths


def variable_lengths(rank, world, codegen):
    """Dynamic padding: every rank sees another sequence length, changing every step."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=32)
    model = GPT(config)
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    step = compiled(model, codegen)
    lengths = [[8, 12], [16, 9], [11, 16]]  # per step, per rank

    def batch(s, r):
        idx, targets = gpt_batch(2, config, seed=100 * s + r)
        return idx[:, : lengths[s][r]], targets[:, : lengths[s][r]]

    def loss_of(model_, s, r):
        idx, targets = batch(s, r)
        logits = model_(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return train_both(
        model,
        reference,
        lambda s: loss_of(step, s, rank),
        lambda s: sum(loss_of(reference, s, r) for r in range(world)) / world,
        sgd,
    )


# --------------------------------------------------------------------- 6. checkpointing


class AttentionBlock(nn.Module):
    """A transformer block whose attention is ``scaled_dot_product_attention`` fed by sharded
    linears (as torch's own test Transformer)."""

    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class CheckpointedTransformer(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList([AttentionBlock() for _ in range(2)])
        self.head = nn.Linear(16, 5)
        if how == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            self.blocks = nn.ModuleList([checkpoint_wrapper(b) for b in self.blocks])

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.how == "function" else block(x)
        return self.head(x)


def checkpointed_attention(rank, world, codegen, how):
    torch.manual_seed(0)
    model = CheckpointedTransformer(how)
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    step = compiled(model, codegen)
    x = torch.randn(2 * world, 6, 16, generator=torch.Generator().manual_seed(4))
    mine = x[2 * rank : 2 * rank + 2]
    return train_both(
        model,
        reference,
        lambda _: step(mine).square().mean(),
        lambda _: (
            sum(reference(x[2 * r : 2 * r + 2]).square().mean() for r in range(world)) / world
        ),
        sgd,
        steps=2,
    )


# --------------------------------------------------------------------- 7. casts and moves


def casts(rank, world, codegen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    applied = []
    for fn in (
        lambda m: m.double(),
        lambda m: m.half(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.float(),
        lambda m: m.to("cpu"),
    ):
        fn(model)
        fn(reference)
        applied.append(sorted({str(p.dtype) for p in model.parameters()}))
    step = compiled(model, codegen)
    x = torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(5))
    out = train_both(
        model,
        reference,
        lambda _: step(x[2 * rank : 2 * rank + 2]).square().mean(),
        lambda _: (
            sum(reference(x[2 * r : 2 * r + 2]).square().mean() for r in range(world)) / world
        ),
        sgd,
    )
    out["dtypes"] = applied
    model.to(torch.bfloat16)
    step(x[:2].bfloat16()).float().sum().backward()  # the compiled model follows the cast
    out["bf16_grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
    return out


# --------------------------------------------------------------------- 8. assignment after shard()


def _grow(model):
    """Parameters, modules and a tie added after wrapping (on the reference, the same calls)."""
    torch.manual_seed(11)
    model.body[1].scale = nn.Parameter(torch.full((6,), 1.5))
    model.head = nn.Linear(6, 6, bias=False)
    model.head.weight = model.embed.weight  # weight tying after wrapping


class Growing(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 6, bias=False)
        self.body = nn.Sequential(nn.Linear(6, 6), _Scaled())
        self.head = None

    def forward(self, x):
        return self.head(self.body(self.embed(x)))


class _Scaled(nn.Module):
    def forward(self, x):
        return x.tanh() * getattr(self, "scale", 1.0)


def assigned_after_shard(rank, world, codegen):
    torch.manual_seed(0)
    model = Growing()
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    _grow(model)
    _grow(reference)
    sharded = {
        "scale": state_of(model.body[1]._parameters["scale"]) is not None,
        "head": state_of(model.head._parameters["weight"]) is not None,
        "tied": model.head._parameters["weight"] is model.embed._parameters["weight"],
    }
    step = compiled(model, codegen)
    x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(6))
    out = train_both(
        model,
        reference,
        lambda _: step(x[2 * rank : 2 * rank + 2]).square().mean(),
        lambda _: (
            sum(reference(x[2 * r : 2 * r + 2]).square().mean() for r in range(world)) / world
        ),
        sgd,
    )
    out["sharded"] = sharded
    return out


# --------------------------------------------------------------------- 9. recurrent layers


class Recurrent(nn.Module):
    def __init__(self, cell: str):
        super().__init__()
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(6, 10, num_layers=2, batch_first=True)
        self.head = nn.Linear(10, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).square().mean()


def recurrent(rank, world, codegen, cell):
    torch.manual_seed(0)
    model = Recurrent(cell)
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=120)
    step = compiled(model, codegen)
    x = torch.randn(2 * world, 5, 6, generator=torch.Generator().manual_seed(8))
    out = train_both(
        model,
        reference,
        lambda _: step(x[2 * rank : 2 * rank + 2]),
        lambda _: sum(reference(x[2 * r : 2 * r + 2]) for r in range(world)) / world,
        sgd,
    )
    # full-size weights the module keeps between steps (its own attributes, not the shards)
    full_sizes = {tuple(s.full_shape) for s in module_state(model.rnn).params.values()}
    out["kept_full_weights"] = [
        key
        for key, value in vars(model.rnn).items()
        for t in (value if isinstance(value, (list, tuple)) else [value])
        if isinstance(t, torch.Tensor)
        and tuple(t.shape) in full_sizes
        and not hasattr(t, "to_local")
    ]
    # an eager read's _base chain ends (torch 2.11's dynamo follows it when such a tensor enters
    # a compiled frame: a chain of fresh linked views never ended)
    t, links = model.rnn.weight_ih_l0, 0
    while t._base is not None and links < 8:
        t, links = t._base, links + 1
    out["base_chain"] = (links, type(t).__name__)
    return out


SCENARIOS: dict[str, Any] = {
    "no_grad_first": no_grad_first,
    "unused_output": unused_output,
    "writes_after_shard": writes_after_shard,
    "write_in_compiled_forward": write_in_compiled_forward,
    "moe": moe,
    "variable_lengths": variable_lengths,
    "checkpointed_attention": checkpointed_attention,
    "casts": casts,
    "assigned_after_shard": assigned_after_shard,
    "recurrent": recurrent,
}


def run_scenario(rank, world, name, *args):
    """One scenario; an unexpected error becomes its result (the other scenarios still run)."""
    import traceback

    torch._dynamo.reset()
    try:
        return SCENARIOS[name](rank, world, *args)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-3000:]}
