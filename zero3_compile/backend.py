"""The ``zero3`` dynamo backend: AOTAutograd wiring, the pass pipeline, codegen.

```
dynamo graph -> aot_autograd (joint graph) -> Zero3Partitioner: dedupe, tag, min-cut partition
             -> forward / backward graphs  -> pipeline: buckets, lower, prefetch, reduce-scatters
             -> cross-rank collective check -> codegen: inductor (compile_fx_inner) or eager (FX)
```
Both codegens share the partitioner and the passes; inductor's own ``compile_fx`` drives the
inductor path (decompositions, joint-graph passes, cudagraph and stride bookkeeping), with our
partitioner plugged in through its ``custom_partitioner_fn`` hook and our passes run on each
graph before it reaches Inductor.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from .debug import GraphRecord, _record
from .fingerprint import check_generated_order, check_same_on_all_ranks, collective_signature
from .graph_utils import output_node, root_placeholder
from .inspect.report import build_report
from .meta import NUM_USER_OUTPUTS
from .ops import UNSHARD, UnshardCall
from .options import Options
from .passes import dedupe_gathers
from .passes.verify import ScheduleError
from .pipeline import Dumper, run_pipeline
from .plan import Plan
from .shard import is_sharded

log = logging.getLogger(__name__)

_SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))


def zero3_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | Options | None = None,
    mode: str | None = None,
):
    """``torch.compile(model, backend="zero3", options={...})``; see ``Options`` for the keys."""
    opts = Options.from_dict(options)
    _check_ready(gm, example_inputs)
    plan = Plan(options=opts)
    dedupe_gathers(gm, plan.for_graph("joint"))  # before AOTAutograd traces one reduce per use
    gm.recompile()
    if opts.codegen == "eager":
        if mode not in (None, "default"):
            log.warning("zero3: mode=%r only applies to codegen='inductor'; ignored", mode)
        return _compile_eager(gm, example_inputs, plan)
    return _compile_inductor(gm, example_inputs, plan, mode)


def _check_ready(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zero3: torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "and zero3_compile.shard(model) before torch.compile(model, backend='zero3')"
        )
    candidates = list(example_inputs) + [p for _, p in gm.named_parameters()]
    plain = [t for t in candidates if isinstance(t, nn.Parameter) and not is_sharded(t)]
    if plain:
        shapes = ", ".join(str(tuple(p.shape)) for p in plain[:3])
        raise ValueError(
            f"zero3: the compiled model has {len(plain)} parameter(s) that are not sharded "
            f"(shapes {shapes}{', ...' if len(plain) > 3 else ''}); call zero3_compile.shard(model) "
            "before torch.compile(model, backend='zero3')"
        )


# --------------------------------------------------------------------------- partitioning


class Zero3Partitioner(CustomPartitionerFn):
    """Joint-graph passes, then the min-cut partitioner; checks nothing gathered is saved."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        run_pipeline(gm, self.plan.for_graph("joint"))
        kwargs.setdefault("compiler", "inductor")
        fw_module, bw_module = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        fw_module.meta[NUM_USER_OUTPUTS] = kwargs["num_fwd_outputs"]
        if self.plan.options.reshard_after_forward:
            _check_no_gathered_saved(fw_module, kwargs["num_fwd_outputs"])
        return fw_module, bw_module

    def uuid(self) -> str:
        return _source_hash() + repr(self.plan.options)


def _check_no_gathered_saved(fw_module: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Fail if a saved tensor is computed from gathered parameters (and constants) alone.

    Structural on purpose: it does not trust the tags, which Inductor's joint-graph passes may
    drop when they rewrite a node.
    """
    graph = fw_module.graph
    shards = {root_placeholder(UnshardCall.of(n).shard) for n in graph.nodes if n.target is UNSHARD}
    kind: dict[fx.Node, str] = {}  # "shard", "input", "param" (param-only), "const" or "other"
    for node in graph.nodes:
        inputs = {kind[i] for i in node.all_input_nodes}
        if node.op == "placeholder":
            kind[node] = "shard" if node in shards else "input"
        elif node.target is UNSHARD:
            kind[node] = "param"
        elif node.op == "call_function" and inputs <= {"const"}:
            kind[node] = "const"
        elif (
            node.op == "call_function"
            and "param" in inputs
            and inputs <= {"param", "const", "shard"}
        ):
            kind[node] = "param"
        else:
            kind[node] = "other"
    outputs = output_node(graph).args[0]
    saved = [n for n in outputs[num_fwd_outputs:] if isinstance(n, fx.Node)]
    gathered = [n.name for n in saved if kind[n] == "param"]
    if gathered:
        raise ScheduleError(
            f"zero3: the partitioner saved gathered parameters for backward: {gathered}"
        )


@functools.cache
def _source_hash() -> str:
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(_SOURCE_DIR)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------- scheduling


def _schedule(gm: fx.GraphModule, plan: Plan) -> GraphRecord:
    graph_id = run_pipeline(gm, plan)
    label = f"{plan.graph_kind} graph {graph_id}"
    check_same_on_all_ranks(gm.graph, label, plan.options.sync_timeout_s)
    record = GraphRecord(kind=plan.graph_kind, graph_id=graph_id, gm=gm)
    _record(record)
    Dumper(plan, graph_id, dist.get_rank()).write_text(
        "report.json", lambda: build_report(record).to_json()
    )
    log.info("[rank %d] zero3: %s", dist.get_rank(), _summary(gm, label))
    return record


def _summary(gm: fx.GraphModule, label: str) -> str:
    signature = collective_signature(gm.graph)
    counts: dict[str, int] = {}
    for kind, *_ in signature:
        counts[kind] = counts.get(kind, 0) + 1
    described = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no collectives"
    return f"{label}: {described}"


def _graph_kind(kwargs: dict[str, Any]) -> str:
    if kwargs.get("is_backward"):
        return "backward"
    return "inference" if kwargs.get("is_inference") else "forward"


# --------------------------------------------------------------------------- codegen


def _compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], plan: Plan):
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind: str):
        def compile_graph(graph_module: fx.GraphModule, _inputs):
            _schedule(graph_module, plan.for_graph(kind))
            return _boxed(graph_module)

        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=Zero3Partitioner(plan),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def _boxed(gm: fx.GraphModule):
    """Run the FX graph with the boxed calling convention, so inputs die as early as possible."""
    try:
        from torch.fx.graph import _BoxedCodeGen

        gm.graph.set_codegen(_BoxedCodeGen())
        gm.recompile()
        forward = gm.forward

        def run(args):
            return forward(args)

    except ImportError:  # pragma: no cover - older torch

        def run(args):
            return torch.fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], plan: Plan, mode: str | None
):
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph_module: fx.GraphModule, inputs, **kwargs):
        record = _schedule(graph_module, plan.for_graph(_graph_kind(kwargs)))
        compiled = compile_fx_inner(graph_module, inputs, **kwargs)
        record.source_code = getattr(compiled, "source_code", None)
        check_generated_order(
            graph_module.graph, record.source_code, f"{record.kind} graph {record.graph_id}"
        )
        return compiled

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(mode))
    patches["custom_partitioner_fn"] = Zero3Partitioner(plan)
    # Our schedule already decides where gathers are issued and waited; Inductor's peak-memory
    # reordering would move every all-gather down to its wait (no overlap left).
    patches["reorder_for_peak_memory"] = False
    # A cache hit would skip our compile step, and with it the cross-rank collective check,
    # on some ranks only (they share the cache directory): always compile.
    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def register() -> None:
    """Make ``backend="zero3"`` available (the package entry point does it without an import)."""
    from torch._dynamo.backends import registry

    if "zero3" in registry._COMPILER_FNS or registry._BACKENDS.get("zero3") is not None:
        return  # registered already, or the entry point will register us on first lookup
    registry.register_backend(zero3_backend, name="zero3")
