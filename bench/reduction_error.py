"""The rounding error of a quantized gradient reduction across nodes, three ways, on real
gradients: why ``QuantizedNodeReduce`` sums exactly within each node.

    python -m bench.reduction_error                       # gpt and llama, 4 and 8 ranks

One process trains the byte-level LM of ``bench/compression.py`` (its corpus, AdamW at 1e-3)
and, every ``--every`` steps, takes the gradients of N ranks' batches (``--rows`` sequences each,
as N ranks of that bench would) and reduces them, simulated, as N ranks in nodes of k would:

- flat: every rank's row for each owner quantized (int4 or int8, stochastic rounding, blocks
  starting at each parameter), one all-to-all, the owner's own row exact (``QuantizedReduceScatter``);
- exact in the node: each node's rows summed exactly, only the other nodes' sums quantized, the
  owner's node's sum exact (``QuantizedNodeReduce``);
- both levels: the sum within the node quantized as well, each level keeping the receiver's own
  part exact (ZeRO++'s hierarchical all-to-all).

Reported: the error of the reduced mean, its root mean square over every element relative to the
mean's (``rms(reduced - mean) / rms(mean)``), per layout, at each point of training. The rows are
each parameter's dim-0 shards (padded as the library pads them), quantized with the library's own
``quantize_rows``.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.harness.models import PRESETS, TEXT_MODELS, build_model, lm_loss, text_batch, text_corpus
from zero3_compile.collectives import quantize
from zero3_compile.sharding.spec import spec_of_shape


def rows_of(grad: torch.Tensor, world: int) -> torch.Tensor:
    """(world, shard numel): rank r's dim-0 shard of ``grad``, zero-padded as shards are."""
    spec = spec_of_shape(grad.shape if grad.dim() else (1,), world)
    padded = grad.new_zeros(spec.gathered_shape())
    padded[: spec.dim0] = grad.reshape(spec.shape)
    return padded.reshape(world, spec.padded_numel)


def rounded(rows: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Each row quantized (stochastically) and dequantized, as its receiver reads it."""
    payload = quantize.quantize_rows(rows, block, bits, stochastic=True)
    return quantize.dequantize_rows(payload, rows.shape[1], block, bits, torch.float32)


def reduced(grads: list[torch.Tensor], size: int, layout: str, bits: int, block: int):
    """The sum each owner ends with, (world, shard numel), for one parameter's ``grads`` (one
    per rank) reduced across nodes of ``size`` ranks in ``layout``."""
    world = len(grads)
    nodes = world // size
    rows = torch.stack([rows_of(g, world) for g in grads])  # [sender, owner, :]
    q = torch.stack([rounded(r, bits, block) for r in rows])
    out = torch.empty_like(rows[0])
    for owner in range(world):
        own_node = owner // size
        if layout == "flat":
            out[owner] = rows[owner, owner] + sum(q[i, owner] for i in range(world) if i != owner)
            continue
        members = [range(n * size, (n + 1) * size) for n in range(nodes)]
        if layout == "exact in the node":
            sums = [sum(rows[i, owner] for i in m) for m in members]
        else:  # both levels: the node's sum collected by the member of the owner's index
            index = owner % size
            sums = [
                sum(rows[i, owner] if i % size == index else q[i, owner] for i in m)
                for m in members
            ]
        across = rounded(torch.stack(sums), bits, block)
        out[owner] = sums[own_node] + sum(across[n] for n in range(nodes) if n != own_node)
    return out


LAYOUTS = ("flat", "exact in the node", "both levels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--meshes", default="4x2,8x2,8x4", help="ranks x ranks per node")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--rows", type=int, default=8, help="sequences per rank")
    args = parser.parse_args()
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    torch.manual_seed(0)
    data = text_corpus()
    train = data[: data.numel() * 9 // 10]
    print(
        f"int{args.bits}, blocks of {args.block}; relative rms error of the reduced mean\n\n"
        "| model | step | ranks x per node | " + " | ".join(LAYOUTS) + " |"
    )
    print("|---|---:|---|" + "---:|" * len(LAYOUTS))
    for name in args.models.split(","):
        model = build_model(PRESETS[TEXT_MODELS[name]], seed=1, device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        world_max = max(w for w, _ in meshes)
        for step in range(args.steps + 1):
            if step % args.every == 0:
                grads = []
                for _ in range(world_max):
                    model.zero_grad()
                    lm_loss(model, text_batch(train, args.rows, gen)).backward()
                    grads.append([p.grad.detach().clone() for p in model.parameters()])
                for world, size in meshes:
                    cells = []
                    for layout in LAYOUTS:
                        error = total = 0.0
                        for i in range(len(grads[0])):
                            per_rank = [g[i] for g in grads[:world]]
                            exact = rows_of(sum(per_rank), world)
                            got = reduced(per_rank, size, layout, args.bits, args.block)
                            error += float(((got - exact) ** 2).sum())
                            total += float((exact**2).sum())
                        cells.append(f"{math.sqrt(error / total):.4f}")
                    print(f"| {name} | {step} | {world} x {size} | " + " | ".join(cells) + " |")
            if step < args.steps:
                opt.zero_grad()
                lm_loss(model, text_batch(train, 4 * args.rows, gen)).backward()
                opt.step()


if __name__ == "__main__":
    main()
