"""The systems under comparison: how each wraps the same model and runs one training step.

Every contender trains the same model from the same seed with the same AdamW hyperparameters in
fp32; each rank takes its slice of the same global batch, and gradients are averaged over ranks
(``single`` takes the whole batch in one process: the reference trajectory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .memory import storage_bytes
from .models import lm_loss, transformer_blocks


@dataclass(frozen=True)
class OptimConfig:
    # 3e-4: at 1e-3 the 25M-parameter GPT's first 20 AdamW steps are chaotic (the loss rises), and
    # rounding-level differences (one batch vs two half-batches, one process) grow to 2% by step 18
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def adamw(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay
        )


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    backend: str  # process-group backend: "gloo", "nccl" or "fake"
    per_rank_batch: int
    optim: OptimConfig = field(default_factory=OptimConfig)
    zero3_options: dict[str, Any] = field(default_factory=dict)  # extra backend options


class Trainer:
    """One training step of a wrapped model with a torch optimizer."""

    def __init__(self, step_module: Callable, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.step_module = step_module  # what forward is called on (wrapped and/or compiled)
        self.model = model  # the module owning the parameters
        self.optimizer = optimizer

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = lm_loss(self.step_module, batch)
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        """Parameters, gradients and optimizer state this rank holds (call after backward)."""
        params = list(self.model.parameters())
        state = self.optimizer.state.values()
        return {
            "params": storage_bytes(params),
            "grads": storage_bytes(p.grad for p in params),
            "optimizer": storage_bytes(
                v for s in state for k, v in s.items() if torch.is_tensor(v) and k != "step"
            ),
        }

    def held_in_cpp_bytes(self) -> int:
        """Persistent buffers only C++ references (invisible to the gc scan of memory.py)."""
        return 0


class DDPTrainer(Trainer):
    def __init__(self, step_module, model, optimizer, ddp: nn.Module):
        super().__init__(step_module, model, optimizer)
        self.ddp = ddp

    def held_in_cpp_bytes(self) -> int:
        # DDP's reducer copies gradients into flat buckets it allocates in C++
        # (gradient_as_bucket_view=False, the default): one extra gradient-sized buffer.
        data = self.ddp._get_ddp_logging_data()
        if data.get("gradient_as_bucket_view"):
            return 0
        return sum(int(size) for size in str(data.get("bucket_sizes", "")).split(",") if size)


class DeepSpeedTrainer(Trainer):
    def __init__(self, engine):
        super().__init__(engine, engine.module, engine.optimizer)
        self.engine = engine

    def forward_backward(self, batch):
        loss = lm_loss(self.engine, batch)
        self.engine.backward(loss)
        return loss.detach()

    def optimizer_step(self) -> None:
        self.engine.step()  # steps the optimizer and zeroes the gradients

    def state_bytes(self) -> dict[str, int]:
        """The ZeRO-3 optimizer's partitions: flat fp32 parameter/gradient buffers and state."""
        zero = self.engine.optimizer
        params = list(self.model.parameters())
        flat_params = [*zero.fp16_partitioned_groups_flat, *zero.fp32_partitioned_groups_flat]
        persistent = [p.data for p in params if getattr(p, "ds_persist", False)]
        flat_grads = [getattr(zero, "grad_partitions_flat_buffer", None)]
        flat_grads += [t.grad for t in zero.fp32_partitioned_groups_flat]
        state = zero.optimizer.state.values()
        return {
            "params": storage_bytes([*(p.ds_tensor for p in params), *flat_params, *persistent]),
            "grads": storage_bytes(flat_grads),
            "optimizer": storage_bytes(
                v for s in state for k, v in s.items() if torch.is_tensor(v) and k != "step"
            ),
        }


# --------------------------------------------------------------------------- process groups


def init_torch_distributed(ctx: Context) -> None:
    if ctx.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=ctx.rank, world_size=ctx.world)
    else:
        dist.init_process_group(ctx.backend, rank=ctx.rank, world_size=ctx.world)


def init_deepspeed_distributed(ctx: Context) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend=ctx.backend)


# --------------------------------------------------------------------------- setups


def setup_single(model: nn.Module, ctx: Context) -> Trainer:
    return Trainer(model, model, ctx.optim.adamw(model.parameters()))


def mark_blocks_as_regions(model: nn.Module) -> None:
    """torch's own compile-once: each kind of block's ``forward`` a nested compile region (its
    class changed: one process per contender)."""
    for cls in {type(block) for block in transformer_blocks(model)}:
        cls.forward = torch.compiler.nested_compile_region(cls.forward)


def setup_single_compiled(model: nn.Module, ctx: Context, regions: bool = False) -> Trainer:
    if regions:
        mark_blocks_as_regions(model)
    return Trainer(torch.compile(model), model, ctx.optim.adamw(model.parameters()))


def setup_ddp(model: nn.Module, ctx: Context, compiled: bool = False) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    # compile the DDP wrapper (dynamo's DDPOptimizer splits the graph at bucket boundaries)
    step_module = torch.compile(ddp) if compiled else ddp
    return DDPTrainer(step_module, model, ctx.optim.adamw(model.parameters()), ddp)


def setup_fsdp2(model: nn.Module, ctx: Context, compiled: bool = False) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    blocks = transformer_blocks(model)
    if compiled:
        # torchtitan's recipe: compile each block (repeated structure: one compilation serves
        # all blocks) before fully_shard, so FSDP2's hooks run eagerly around compiled code
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, fullgraph=True)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Trainer(model, model, ctx.optim.adamw(model.parameters()))


def setup_zero3(
    model: nn.Module,
    ctx: Context,
    codegen: str = "inductor",
    per_block: bool = False,
    regions: bool = False,
) -> Trainer:
    import zero3_compile as z3

    z3.shard(model)
    optimizer = ctx.optim.adamw(model.parameters())
    options = {"codegen": codegen, **ctx.zero3_options}
    if regions:  # the whole model, each kind of block compiled once (nested compile regions)
        z3.compile_once(transformer_blocks(model))
    if not per_block:
        step_module = torch.compile(model, backend="zero3", options=options)
        return Trainer(step_module, model, optimizer)
    for block in transformer_blocks(model):  # FSDP2's habit; the rest of the model runs eagerly
        block.compile(backend="zero3", options=options)
    return Trainer(model, model, optimizer)


def deepspeed_config(ctx: Context) -> dict[str, Any]:
    o = ctx.optim
    return {
        "train_micro_batch_size_per_gpu": ctx.per_rank_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": ctx.per_rank_batch * ctx.world,
        "zero_optimization": {"stage": 3},  # defaults otherwise, as a user would start
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": True,  # torch.optim.AdamW: the same update as everyone else
            },
        },
        "steps_per_print": 1 << 30,
    }


def setup_deepspeed(model: nn.Module, ctx: Context, compiled: bool = False) -> Trainer:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=deepspeed_config(ctx)
    )
    if compiled:
        engine.compile()
    return DeepSpeedTrainer(engine)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Contender:
    name: str
    description: str
    setup: Callable[[nn.Module, Context], Trainer]
    distributed: bool = True  # False: one process, whole batch
    comm_source: str = "profiler"  # "graphs": read from zero3's compiled graphs
    requires: str | None = None  # an optional package
    compiled: bool = False

    def init_process_group(self, ctx: Context) -> None:
        if not self.distributed:
            return
        if self.requires == "deepspeed":
            init_deepspeed_distributed(ctx)
        else:
            init_torch_distributed(ctx)


def _partial(fn, **kwargs):
    def setup(model: nn.Module, ctx: Context) -> Trainer:
        return fn(model, ctx, **kwargs)

    return setup


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender(
            "zero3",
            "this project, inductor codegen",
            _partial(setup_zero3),
            comm_source="graphs",
            compiled=True,
        ),
        Contender(
            "zero3-eager-codegen",
            "this project, scheduled FX graphs run as they are",
            _partial(setup_zero3, codegen="eager"),
            comm_source="graphs",
            compiled=True,
        ),
        Contender(
            "zero3-regions",
            "this project, whole model with z3.compile_once(blocks): one compiled body per kind",
            _partial(setup_zero3, regions=True),
            comm_source="graphs",
            compiled=True,
        ),
        Contender(
            "zero3-per-block",
            "this project, each block compiled (block.compile), the rest eager",
            _partial(setup_zero3, per_block=True),
            comm_source="graphs",
            compiled=True,
        ),
        Contender("fsdp2", "FSDP2 fully_shard per block + root, eager", _partial(setup_fsdp2)),
        Contender(
            "fsdp2-compiled",
            "FSDP2, each block torch.compile'd before fully_shard",
            _partial(setup_fsdp2, compiled=True),
            compiled=True,
        ),
        Contender(
            "deepspeed",
            "DeepSpeed ZeRO-3, eager",
            _partial(setup_deepspeed),
            requires="deepspeed",
        ),
        Contender(
            "deepspeed-compiled",
            "DeepSpeed ZeRO-3, engine.compile()",
            _partial(setup_deepspeed, compiled=True),
            requires="deepspeed",
            compiled=True,
        ),
        Contender("ddp", "DDP, eager (unsharded reference)", _partial(setup_ddp)),
        Contender(
            "ddp-compiled",
            "torch.compile(DDP(model))",
            _partial(setup_ddp, compiled=True),
            compiled=True,
        ),
        Contender(
            "single",
            "one process, whole batch, eager (loss reference)",
            setup_single,
            distributed=False,
        ),
        Contender(  # not in compare.py's default set: gpu.py's unsharded compile reference
            "single-compiled",
            "one process, whole batch, torch.compile(model)",
            setup_single_compiled,
            distributed=False,
            compiled=True,
        ),
        Contender(  # compile_time.py --depth: the floor of zero3-regions, torch's own
            "single-regions",
            "one process, whole batch, torch.compile(model), each kind of block compiled once",
            _partial(setup_single_compiled, regions=True),
            distributed=False,
            compiled=True,
        ),
    )
}
DEFAULT_SET = [name for name in CONTENDERS if not name.startswith("single-")]

REFERENCE = "single"  # the loss trajectory every other contender must follow
SPEED_BASELINE = "fsdp2"  # step-time ratios are relative to this one


def contender_env(contender: Contender, device_type: str) -> dict[str, str]:
    """Environment a contender's processes need before any import."""
    env = {}
    if contender.requires == "deepspeed" and device_type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def missing_requirement(contender: Contender) -> str | None:
    """Why a contender cannot run here (its optional package is not installed), or None."""
    import importlib.util

    if contender.requires and importlib.util.find_spec(contender.requires) is None:
        return (
            f"the optional package {contender.requires!r} is not installed "
            f"(pip install -e '.[bench]' adds it)"
        )
    return None
