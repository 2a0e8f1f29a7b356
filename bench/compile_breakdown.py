"""Where a cold compile's time goes, against depth: torch's own nested compile regions (the
unsharded model in one process) beside zero3's ``compile_once`` (2 gloo ranks), per stage of
torch's compiler (``torch._dynamo.utils.compile_times()``, rank 0).

    python -m bench.compile_breakdown --depth 2,80

Each run starts with an empty Inductor cache and times one first step (forward and backward,
GPT blocks of width 128, Inductor codegen). The table gives each stage's seconds at every depth;
a stage is a span of torch's compiler, and spans nest (``compile_fx_inner`` holds the lowering
and codegen rows), so the rows do not add up. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from bench.harness.contenders import mark_blocks_as_regions
from bench.harness.launch import run_ranks
from bench.harness.models import PRESETS, build_model, global_batch, transformer_blocks
from bench.harness.paths import results_dir

# (row label, torch's span names, summed): the spans that grow with depth, outermost first
STAGES = (
    ("first step", None),
    ("dynamo: bytecode tracing", "bytecode_tracing"),
    (
        "dynamo: region reuse (lookup + stamp out)",
        "invoke_subgraph_reuse_lookup invoke_subgraph_reuse_stamp_out",
    ),
    ("AOTAutograd: metadata", "aot_collect_metadata"),
    ("AOTAutograd: joint trace", "aot_trace_joint_graph"),
    ("partitioner: torch's min-cut", "min_cut_rematerialization_partition"),
    ("partitioner: zero3's", "Zero3Partitioner"),
    ("Inductor: compile_fx_inner", "compile_fx_inner"),
    ("Inductor: fake-tensor propagation", "additional_fake_tensor_prop"),
    ("Inductor: post-grad passes", "_recursive_post_grad_passes"),
    ("Inductor: lowering", "GraphLowering.run"),
    ("Inductor: codegen", "GraphLowering.codegen"),
    ("Inductor: C++ builds", "compile_file"),
)


def first_step(rank: int, world: int, mode: str, depth: int) -> dict[str, float]:
    """One cold first step; the seconds of each stage of ``STAGES`` (rank 0's)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-breakdown-")
    torch.set_num_threads(1)
    preset = PRESETS["gpt-w128"]
    preset = replace(preset, config=replace(preset.config, n_layer=depth))
    model = build_model(preset, 0, "cpu")
    if mode == "zero3":
        import zero3_compile as z3

        dist.init_process_group("gloo")
        z3.shard(model)
        z3.compile_once(transformer_blocks(model))
        step = torch.compile(model, backend="zero3", options={"codegen": "inductor"})
    else:
        mark_blocks_as_regions(model)
        step = torch.compile(model)
    inputs, targets = global_batch(preset, world, 0, 0)
    inputs, targets = inputs[rank::world], targets[rank::world]  # a rank's rows: the same shapes
    start = time.perf_counter()
    logits = step(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    seconds = time.perf_counter() - start
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    spans = dict(zip(names, map(float, values)))
    out = {"first step": seconds}
    for label, span_names in STAGES[1:]:
        out[label] = sum(spans.get(name, 0.0) for name in span_names.split())
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", default="2,80")
    parser.add_argument("--out", default=results_dir())
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depth.split(",")]
    logs = os.path.join(args.out, "logs")
    columns = {}
    for depth in depths:
        print(f"torch's regions at {depth} blocks ...", file=sys.stderr, flush=True)
        (columns[("torch", depth)],) = run_ranks(
            first_step, 1, ("torch", depth), log_dir=logs, name=f"breakdown-torch-{depth}",
            timeout_s=3600,
        )  # fmt: skip
        print(f"zero3 compile_once at {depth} blocks ...", file=sys.stderr, flush=True)
        columns[("zero3", depth)] = run_ranks(
            first_step, 2, ("zero3", depth), log_dir=logs, name=f"breakdown-zero3-{depth}",
            timeout_s=3600,
        )[0]  # fmt: skip
    heads = [f"{who} {d}" for d in depths for who in ("torch", "zero3")]
    print(f"\ncold first step by stage (s), rank 0, torch {torch.__version__}\n")
    print("| stage | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for label, _ in STAGES:
        cells = [columns[(who, d)][label] for d in depths for who in ("torch", "zero3")]
        print(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
