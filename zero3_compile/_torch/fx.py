"""FX and dispatch internals: op overload types, fake values, boxed codegen, dispatch modes."""

from __future__ import annotations

import torch

# ``TorchDispatchMode``: the base class of a mode that sees every ATen call (private module
# ``torch.utils._python_dispatch``; torch's docs on extending point to it), 2.11-2.14.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "OpOverload",
    "TorchDispatchMode",
    "boxed_codegen",
    "fake_tensor_types",
    "node_name",
    "schema_of",
]

# ``torch._ops.OpOverload``: the type of ATen / custom op overloads in FX graphs (private module,
# no public alias), 2.11-2.14.
OpOverload = torch._ops.OpOverload


def fake_tensor_types():
    """(FakeTensor, FakeTensorMode): the fake values of graph nodes (private
    ``torch._subclasses``; no public alternative), 2.11-2.14."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor, FakeTensorMode


def boxed_codegen():
    """FX codegen with the boxed calling convention (inputs freed as early as possible).
    Private ``torch.fx.graph._BoxedCodeGen``; present 2.11-2.14."""
    from torch.fx.graph import _BoxedCodeGen

    return _BoxedCodeGen()


def schema_of(op) -> torch.FunctionSchema:
    """An op overload's ``FunctionSchema`` (private ``OpOverload._schema``): its arguments by
    position and name, which of them an op writes (``alias_info.is_write``) and whether it is
    mutable. No public alternative; checked 2.13-2.14."""
    return op._schema


def node_name(graph: torch.fx.Graph, name: str) -> str:
    """The node name FX itself derives from ``name`` when it names a node after its target
    (private ``Graph._target_to_str``: snake case, magic-method underscores dropped), for
    ``graph.create_node(..., name=node_name(graph, name))``; checked 2.13-2.14."""
    return graph._target_to_str(name)
