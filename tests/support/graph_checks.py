"""Structural checks of compiled graphs, independent of the passes' own metadata."""

from __future__ import annotations

import re

import torch.fx as fx

from zero3_compile._torch.c10d import ALL_GATHER, ALL_REDUCE, ALL_REDUCE_INPLACE, REDUCE_SCATTER
from zero3_compile._torch.inductor import generated_events
from zero3_compile.compiler.graph_facts import param_derived
from zero3_compile.compiler.node_keys import PARAMS, ROLE, ROLE_REDUCE_SCATTER
from zero3_compile.compiler.recording import GraphRecord
from zero3_compile.compiler.signature import scheduled_events


def saved_gathered_parameters(record: GraphRecord) -> list[str]:
    """Saved-for-backward tensors of a forward graph that are gathered parameters, or functions
    of gathered parameters alone (``graph_facts.param_derived``: the one definition the
    partitioner's own check uses)."""
    derived = param_derived(record.gm.graph)
    return [f"{n.name}{tuple(n.meta['val'].shape)}" for n in record.saved if n in derived]


def is_reduce_scatter(node: fx.Node) -> bool:
    """A gradient reduce-scatter, also where it is issued as an all-reduce of the bucket (in
    place on gloo groups, ``schemes.gloo_reduce_scatter_as_all_reduce``)."""
    if node.target is REDUCE_SCATTER:
        return True
    return (
        node.target in (ALL_REDUCE, ALL_REDUCE_INPLACE)
        and node.meta.get(ROLE) == ROLE_REDUCE_SCATTER
    )


def collective_counts(gm: fx.GraphModule) -> dict[str, int]:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return {
        "all_gather": sum(n.target is ALL_GATHER for n in nodes),
        "reduce_scatter": sum(is_reduce_scatter(n) for n in nodes),
    }


def analyze(records: list[GraphRecord]) -> dict:
    """Per graph kind: collective counts; for forward graphs, the saved gathered parameters."""
    out: dict = {}
    for record in records:
        entry = out.setdefault(
            record.kind, {"all_gather": 0, "reduce_scatter": 0, "saved_gathered": [], "saved": 0}
        )
        for kind, count in collective_counts(record.gm).items():
            entry[kind] += count
        for node in record.gm.graph.nodes:
            if node.target is ALL_GATHER or is_reduce_scatter(node):
                key = "gathered_params" if node.target is ALL_GATHER else "reduced_params"
                entry.setdefault(key, []).extend(node.meta.get(PARAMS, ()))
        if record.kind == "forward":
            entry["saved_gathered"] += saved_gathered_parameters(record)
            entry["saved"] += len(record.saved)
        if record.source_code is not None:
            entry.setdefault("inductor_gathers", []).extend(
                inductor_gather_report(record.source_code)
            )
            entry.setdefault("generated_events", []).append(generated_events(record.source_code))
        entry.setdefault("scheduled_events", []).append(scheduled_events(record.gm.graph))
    return out


# a kernel, or a call of a nested compile region's compiled body (``bufN = partitioned_..(``)
_KERNEL = re.compile(
    r"^\s*(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+|aten\.\w+|torch\.ops\.aten\.\w+"
    r"|\w+ = partitioned_\w+_subgraph_\w+\()"
)
_ALL_GATHER_CALL = re.compile(
    r"^\s*(\w+) = torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\("
)


def inductor_gather_report(source_code: str) -> list[dict]:
    """For each all-gather in Inductor's generated code: does compute run between its issue and
    its wait (overlap), and is its buffer deleted or reused right after its last read?"""
    body = source_code.split("def call(self, args):", 1)[1].splitlines()
    report = []
    for i, line in enumerate(body):
        match = _ALL_GATHER_CALL.match(line)
        if not match:
            continue
        buf = match.group(1)
        name = re.compile(rf"\b{buf}\b")
        wait = next(
            j for j in range(i + 1, len(body)) if "wait_tensor" in body[j] and name.search(body[j])
        )
        freed = next(
            (j for j in range(wait + 1, len(body)) if re.search(rf"\bdel {buf}\b", body[j])), None
        )
        reads = [
            j
            for j in range(wait + 1, freed if freed is not None else len(body))
            if name.search(body[j]) and "assert_" not in body[j]
        ]
        last_read = max(reads, default=wait)
        between = [
            j for j in range(last_read + 1, freed or last_read + 1) if _KERNEL.match(body[j])
        ]
        report.append(
            {
                "buffer": buf,
                "overlapped": any(_KERNEL.match(body[j]) for j in range(i + 1, wait)),
                "freed": freed is not None,
                "kernels_between_last_read_and_free": len(between),
            }
        )
    return report
