"""Hybrid sharding, simulated: 2 nodes x 4 ranks on the ``fake`` process group, one process.

    python -m bench.hybrid                          # gpt-small, a 2x4 mesh, zero3 and FSDP2
    python -m bench.hybrid --mesh 4x2 --model quick

Per rank: parameters + gradients + AdamW state held, and the bytes one training step sends on
each group: all-gathers and reduce-scatters within a node (the shard group), all-reduces across
nodes (the replicate group), for zero3 (read from its compiled graphs) and FSDP2's HSDP
(``fully_shard(mesh=2-D mesh)``, counted at its torch.distributed calls), next to plain ZeRO-3
over all 8 ranks, where every all-gather crosses the network. The fake group makes collectives
return at once: memory and bytes are real, times are not reported.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench.harness.models import (
    PRESETS,
    build_model,
    global_batch,
    lm_loss,
    rank_slice,
    transformer_blocks,
)

MiB = 2**20


def _state_bytes(model, opt) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += grad.numel() * grad.element_size()
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _step(model, preset, world, opt):
    batch = rank_slice(global_batch(preset, world, 0, 0), 0, preset.per_rank_batch)
    lm_loss(model, batch).backward()
    opt.step()


def zero3(preset, mesh_shape, hybrid: bool) -> dict:
    import zero3_compile as z3
    from zero3_compile.inspect import build_report

    torch._dynamo.reset()
    model = build_model(preset, 0, "cpu")
    if hybrid:
        z3.shard(
            model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        )
    else:
        z3.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    with z3.record_graphs() as records:
        _step(step, preset, dist.get_world_size(), opt)
    groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        for group, kinds in build_report(record).group_bytes.items():
            name = {"0": "all ranks"}.get(group, group)
            for kind, nbytes in kinds.items():
                groups[name][kind] += nbytes
    return {"state": _state_bytes(model, opt), "groups": groups}


def fsdp2(preset, mesh_shape) -> dict:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    roles = {
        id(mesh["shard"].get_group()): "shard",
        id(mesh["replicate"].get_group()): "replicate",
    }
    groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    originals = {}

    def counting(name, kind, tensor_arg, keyword):
        original = getattr(dist, name)
        originals[name] = original

        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            tensor = args[tensor_arg] if len(args) > tensor_arg else kwargs.get(keyword)
            role = roles.get(id(group), "all ranks")
            if isinstance(tensor, torch.Tensor):
                groups[role][kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        setattr(dist, name, wrapper)

    model = build_model(preset, 0, "cpu")
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    # 2.13 renamed them *_single; FSDP2 calls whichever its release has
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            counting(name, "all_gather", 0, "output_tensor")  # the gathered output
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            counting(name, "reduce_scatter", 1, "input")  # the full input
    counting("all_reduce", "all_reduce", 0, "tensor")
    try:
        _step(model, preset, dist.get_world_size(), opt)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"state": _state_bytes(model, opt), "groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(PRESETS), default="gpt-small")
    parser.add_argument("--mesh", default="2x4", help="nodes x ranks per node")
    args = parser.parse_args(argv)
    mesh_shape = tuple(int(x) for x in args.mesh.split("x"))
    world = mesh_shape[0] * mesh_shape[1]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    preset = PRESETS[args.model]
    rows = {
        f"zero3 HSDP {args.mesh}": zero3(preset, mesh_shape, True),
        f"FSDP2 HSDP {args.mesh}": fsdp2(preset, mesh_shape),
        f"zero3 ZeRO-3 over {world}": zero3(preset, mesh_shape, False),
    }
    print(f"\n{args.model}, {world} ranks simulated (fake process group), rank 0, one AdamW step\n")
    print(
        "| configuration | params+grads+AdamW MiB | within a node: all-gather / reduce-scatter MiB "
        "| across nodes: all-reduce MiB | all ranks: all-gather / reduce-scatter MiB |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        g = row["groups"]
        shard, rep, world_g = g.get("shard", {}), g.get("replicate", {}), g.get("all ranks", {})
        print(
            f"| {name} | {row['state'] / MiB:.1f} | "
            f"{shard.get('all_gather', 0) / MiB:.1f} / {shard.get('reduce_scatter', 0) / MiB:.1f} | "
            f"{rep.get('all_reduce', 0) / MiB:.1f} | "
            f"{world_g.get('all_gather', 0) / MiB:.1f} / {world_g.get('reduce_scatter', 0) / MiB:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
