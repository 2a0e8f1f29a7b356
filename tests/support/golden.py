"""Compact text pictures of graphs, as the passes' docstrings draw them (see test_pass_docs.py)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zero3_compile.compiler.markers import ReduceGradCall, UnshardCall
from zero3_compile.compiler.node_keys import BUCKET

_POLICY = {
    CheckpointPolicy.MUST_RECOMPUTE: "recompute",
    CheckpointPolicy.MUST_SAVE: "save",
}


def _op(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _arg(value) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg(v) for v in value)
        return f"[{inner}]"
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


def _args(node: fx.Node) -> str:
    if node.target.__class__.__name__ == "OpOverload" and _op(node) == "unshard":
        call = UnshardCall.of(node)
        return f"{_arg(call.shard)}, {call.spec.fqn!r}"
    if _op(node) == "reduce_grad":
        call = ReduceGradCall.of(node)
        return f"{_arg(call.grad)}, {call.spec.fqn!r}"
    if _op(node) == "guard":
        return f"{node.args[0]!r}, kind={node.args[2]}"
    parts = [_arg(a) for a in node.args]
    parts += [f"{k}={_arg(v)}" for k, v in node.kwargs.items() if k != "memory_format"]
    return ", ".join(parts)


def picture(gm: fx.GraphModule, *, tags: bool = False, buckets: bool = False) -> str:
    """One line per node: ``name = op(args)``; placeholders on one line, then the output."""
    lines = []
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    lines.append("inputs: " + ", ".join(inputs))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            line = f"{node.name} = {_op(node)}({_args(node)})"
            notes = []
            if tags and node.meta.get("recompute") is not None:
                notes.append(_POLICY.get(node.meta["recompute"], str(node.meta["recompute"])))
            if buckets and BUCKET in node.meta:
                notes.append(f"bucket {node.meta[BUCKET]}")
            lines.append(line + (f"  # {', '.join(notes)}" if notes else ""))
        elif node.op == "output":
            lines.append(f"return {_arg(node.args[0])}")
    return "\n".join(lines)


def docstring_block(fn, label: str) -> str:
    """The lines under ``label:`` in the first fenced block of ``fn``'s docstring, dedented."""
    doc = fn.__doc__ or ""
    block = doc.split("```", 2)[1]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"{label}:")
    out = []
    for line in lines[start + 1 :]:
        if line.strip().endswith(":") and not line.startswith("      "):
            break
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    indent = min(len(line) - len(line.lstrip()) for line in out if line.strip())
    return "\n".join(line[indent:] for line in out)
