"""The ``zero3`` dynamo backend: wires the stages of ``pipeline.PIPELINE`` into AOTAutograd
and codegen.

```
dynamo graph -> run_pipeline: pre-dynamo and dynamo stages
             -> aot_autograd (joint graph) -> Zero3Partitioner: run_pipeline: joint, memory
                                              budget and partition stages
             -> forward / backward graphs  -> run_pipeline: forward or backward stage
             -> codegen: inductor (compile_fx_inner) or eager (FX)
             -> generated code             -> run_pipeline: post-codegen stage (Inductor)
```
Both codegens share the partitioner and the passes; inductor's own ``compile_fx`` drives the
inductor path (decompositions, joint-graph passes, cudagraph and stride bookkeeping), with our
partitioner plugged in through its ``custom_partitioner_fn`` hook and our passes run on each
graph before it reaches Inductor. The callable handed back to dynamo is a ``GatedCall``
(``runtime/gate.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from .._torch.aot_autograd import autograd_cache_disabled, mark_boxed
from .._torch.c10d import backend_of
from .._torch.dynamo import (
    aot_autograd_backend,
    dynamo_compile_count,
    register_dynamo_backend,
)
from .._torch.fx import boxed_codegen
from .._torch.higher_order import region_schemas_cached
from .._torch.inductor import (
    inductor_compile_fx,
    inductor_config_patches,
    partitioner_base,
    stable_mesh_cache_keys,
)
from ..runtime.gate import GatedCall
from ..runtime.guard import DEFAULT_TIMEOUT_S
from ..sharding.nodes import across_nodes_group, node_group, ranks_per_node, reduction_node_size
from ..sharding.state import is_sharded
from . import recording
from .context import CompileContext, Generated, GraphInputs, Partition, source_hash
from .graph_facts import calls_regions, detachable_inputs, output_dependencies
from .graph_utils import copy_graph_module, output_node
from .options import Options
from .pipeline import Dumper, run_pipeline
from .recording import GraphRecord, timed
from .signature import ScheduledOrder, collective_signature, describe_signature

log = logging.getLogger(__name__)


def zero3_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | Options | None = None,
    mode: str | None = None,
):
    """``torch.compile(model, backend="zero3", options={...})``; see ``Options`` for the keys.

    Example:
        ```python
        step_model = torch.compile(model, backend="zero3", options={"bucket_mb": 25})
        ```
    """
    start = time.perf_counter()
    opts = Options.from_dict(options)
    inputs = GraphInputs.of(gm, example_inputs)
    _check_ready(inputs)
    _warn_at_recompile_limit(gm)
    roots = _runtimes(inputs)
    for root in roots:
        root.graphs_compiled += 1
    if opts.sync_timeout_s is None:  # the model's own (shard(sync_timeout_s=...)), in the graphs
        # the longest, if several models with different ones share a graph
        timeout = max((r.timeout_s for r in roots), default=DEFAULT_TIMEOUT_S)
        opts = dataclasses.replace(opts, sync_timeout_s=timeout)
    recording.compiling()
    ctx = CompileContext(opts, recorders=recording.listening())
    run_pipeline(gm, ctx.passes("dynamo", f"{ctx.index}", inputs=inputs))
    # computed here, not from the joint graph: a cache hit of AOTAutograd never traces that
    # (the 2.11 rewrite, the dynamo stage's last pass, changes neither: same flow, same meta)
    ctx.gradient_dependencies.update(output_dependencies(gm))
    ctx.detachable_inputs = detachable_inputs(gm)
    ctx.group_names = _group_names(inputs, opts)
    outputs = output_node(gm.graph).args[0]
    num_outputs = len(outputs) if isinstance(outputs, (list, tuple)) else 1
    # nested compile regions: torch traces a body again at every call unless cached
    regions = region_schemas_cached() if calls_regions(gm) else contextlib.nullcontext()
    with regions:
        if opts.codegen == "eager":
            if mode not in (None, "default"):
                log.warning("zero3: mode=%r only applies to codegen='inductor'; ignored", mode)
            compiled = _compile_eager(gm, example_inputs, ctx)
        else:
            compiled = _compile_inductor(gm, example_inputs, ctx, mode)
    recording.add_compile_time(
        "backend total (AOTAutograd and codegen included)", time.perf_counter() - start
    )
    return GatedCall(compiled, ctx, num_outputs)


def _group_names(inputs: GraphInputs, opts: Options) -> tuple[str, ...]:
    """The process groups the graphs' collectives will name; hpZ's node groups are created here
    (by every rank of a shard group, at the same point of the same compile)."""
    names = set()
    hpz = opts.secondary_shard is not None and opts.reshard_after_forward
    size = ranks_per_node(opts.secondary_shard) if hpz else 0
    for state in inputs.states:
        spec = state.spec
        names.update(n for n in (spec.group, spec.replicate_group) if n)
        if hpz and spec.world_size > 1:
            names.add(node_group(spec.group, size).name)
        quantized = opts.gradient_quantization and spec.replicate_size == 1
        per_node = reduction_node_size(spec.group, opts.secondary_shard) if quantized else None
        if per_node:
            # qgZ's two levels (schemes.QuantizedNodeReduce)
            names.add(node_group(spec.group, per_node).name)
            names.add(across_nodes_group(spec.group, per_node).name)
    return tuple(sorted(names))


def _warn_at_recompile_limit(gm: fx.GraphModule) -> None:
    """Once, at the last compile of a frame dynamo allows: what its next variant costs, and the
    fixes (dynamo's own warning comes later, when the variant already runs uncompiled)."""
    count = dynamo_compile_count()
    if count is None or count[1] != count[2]:
        return
    frame, compiles, limit = count
    where = next(
        (
            line.strip()
            for node in gm.graph.nodes
            for line in (node.meta.get("stack_trace") or "").splitlines()
            if line.strip().startswith("File ")
        ),
        "its first line unknown",
    )
    log.warning(
        "zero3: dynamo has compiled frame %s (%s) %d times, its recompile_limit: the next variant "
        "of it will run uncompiled, gathering each parameter with a collective of its own. When "
        "blocks are compiled one by one (block.compile()), they differ in something dynamo "
        "guards on (TORCH_LOGS=recompiles names it: a Python attribute such as a layer index "
        "read in forward, other shapes or dtypes); make the blocks alike, compile their parent "
        "once (torch.compile(model, backend='zero3')), or raise "
        "torch._dynamo.config.recompile_limit.",
        frame,
        where,
        compiles,
    )


def _runtimes(inputs: GraphInputs) -> list:
    """The runtimes of the sharded models whose parameters the graph reads."""
    roots = {id(s.root): s.root for s in inputs.states if s.root is not None}
    return list(roots.values())


def _check_ready(inputs: GraphInputs) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zero3: torch.distributed is not initialised; call torch.distributed.init_process_group() "
            "and zero3_compile.shard(model) before torch.compile(model, backend='zero3')"
        )
    params = inputs.parameters
    plain = [p for p in params if not is_sharded(p)]
    if not plain:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in plain[:3])
    more = ", ..." if len(plain) > 3 else ""
    if any(is_sharded(p) for p in params):
        raise ValueError(
            f"zero3: the compiled model reads {len(plain)} parameter(s) that are not sharded "
            f"(shapes {shapes}{more}), next to sharded ones: a module holding parameters was added "
            "to the model after zero3_compile.shard(model) without going through a sharded module. "
            "Assign it as an attribute of a sharded module (it is sharded on assignment) or call "
            "zero3_compile.shard(new_module) before training; unsharded parameters would train "
            "differently on every rank."
        )
    raise ValueError(
        f"zero3: the compiled model has {len(plain)} parameter(s) that are not sharded "
        f"(shapes {shapes}{more}); call zero3_compile.shard(model) "
        "before torch.compile(model, backend='zero3')"
    )


# --------------------------------------------------------------------------- partitioning


class Zero3Partitioner(partitioner_base()):
    """The partition function AOTAutograd calls: the joint, memory budget and partition stages
    of the pipeline on the joint graph; returns the forward and backward graphs."""

    def __init__(self, ctx: CompileContext):
        self.ctx = ctx

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        kwargs.setdefault("compiler", "inductor")
        partition = Partition(joint_inputs, kwargs)
        run_pipeline(gm, self.ctx.passes("joint", f"{self.ctx.index}", partition=partition))
        if partition.plan is not None:
            self.ctx.plans.append(partition.plan)
        return partition.forward, partition.backward

    def __reduce__(self):
        # Inductor's FX graph cache pickles its config, this object included, into the cache key:
        # the key is the uuid (pickling the compile context would drag in recorded graphs, device
        # meshes and whatever else it holds)
        return (str, (f"zero3-partitioner-{self.uuid()}",))

    def uuid(self) -> str:
        """Part of AOTAutograd's and Inductor's cache keys: our source, the options, the rank
        (ranks compile graphs of their own: shards of uneven sizes, rows of a mesh) and the names
        of the process groups the scheduled graphs' collectives name. Nothing else of this
        process may go into the compiled code (tests/distributed/test_compile_cache.py)."""
        options = self.ctx.options
        budget = (
            f"-budget{options.memory_budget_bytes}" if options.memory_budget_mb == "auto" else ""
        )
        # the groups' backends decide schemes and serialization (``serialize_collectives``)
        groups = ",".join(f"{name}:{backend_of(name)}" for name in self.ctx.group_names)
        reduction = os.environ.get("ZERO3_GLOO_REDUCE_SCATTER", "")
        return (
            f"{source_hash()}-{options!r}{budget}-rank{dist.get_rank()}-groups{groups}"
            f"-rs{reduction}"
        )


# --------------------------------------------------------------------------- scheduling


def _schedule(gm: fx.GraphModule, ctx: CompileContext, kind: str) -> GraphRecord:
    graph_id = ctx.next_graph_id(kind)
    pass_ctx = ctx.passes(kind, graph_id)
    run_pipeline(gm, pass_ctx)
    recorders = ctx.recorders + [r for r in recording.listening() if r not in ctx.recorders]
    # recorded as scheduled: Inductor's own passes rewrite the graph it is handed in place
    copying = recorders and ctx.options.codegen == "inductor"
    shown = copy_graph_module(gm)[0] if copying else gm
    record = GraphRecord(kind=kind, graph_id=graph_id, gm=shown)
    if kind == "forward" and ctx.plans:
        record.budget = ctx.plans[-1]
    for recorder in recorders:
        recorder.add(record)
    rank = dist.get_rank()

    # the report is rendered by the inspection tools (when loaded), only if it is written
    Dumper(pass_ctx, rank).write_text("report.json", lambda: recording.report_json(record) or "{}")
    log.info(
        "[rank %d] zero3: %s graph %s: %s",
        rank,
        kind,
        graph_id,
        describe_signature(collective_signature(gm.graph)),
    )
    return record


def _graph_kind(kwargs: dict[str, Any]) -> str:
    if kwargs.get("is_backward"):
        return "backward"
    return "inference" if kwargs.get("is_inference") else "forward"


# --------------------------------------------------------------------------- codegen


def _compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext):
    def compiler(kind: str):
        def compile_graph(graph_module: fx.GraphModule, _inputs):
            _schedule(graph_module, ctx, kind)
            return _boxed(graph_module)

        return compile_graph

    backend = aot_autograd_backend(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=Zero3Partitioner(ctx),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def _boxed(gm: fx.GraphModule):
    """Run the FX graph with the boxed calling convention, so inputs die as early as possible."""
    gm.graph.set_codegen(boxed_codegen())
    gm.recompile()
    forward = gm.forward

    def run(args):
        return forward(args)

    return mark_boxed(run)


def _compile_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext, mode: str | None
):
    compile_fx, compile_fx_inner = inductor_compile_fx()

    def inner_compile(graph_module: fx.GraphModule, inputs, **kwargs):
        record = _schedule(graph_module, ctx, _graph_kind(kwargs))
        # read before codegen: Inductor rewrites the graph it is handed in place
        scheduled = ScheduledOrder.of(graph_module.graph)
        with timed("Inductor on the scheduled graphs"):
            compiled = compile_fx_inner(graph_module, inputs, **kwargs)
        record.source_code = getattr(compiled, "source_code", None)
        generated = Generated(scheduled, record.source_code)
        pass_ctx = ctx.passes(record.kind, record.graph_id, generated=generated)
        run_pipeline(graph_module, pass_ctx, graph="generated")
        return compiled

    patches = inductor_config_patches(mode)
    # Part of AOTAutograd's cache key (its uuid: our source and options), so a warm restart
    # reuses compiled graphs only for the same package, options and graph (whose markers name the
    # groups and world size). A hit skips our passes but not their product: the cached code runs
    # the cross-rank guard before its collectives.
    patches["custom_partitioner_fn"] = Zero3Partitioner(ctx)
    # someone is recording the graphs (record_graphs, explain, the inspect command): they must be
    # compiled, not loaded from the cache
    caching = contextlib.nullcontext() if not ctx.recorders else autograd_cache_disabled()
    stable_mesh_cache_keys()
    with caching:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def register() -> None:
    """Make ``backend="zero3"`` available (the package entry point does it without an import)."""
    register_dynamo_backend(zero3_backend, "zero3")


__all__ = ["Zero3Partitioner", "register", "zero3_backend"]
