"""FX and dispatch internals: op overload types, fake values, boxed codegen, dispatch modes."""

from __future__ import annotations

import torch

# ``TorchDispatchMode``: the base class of a mode that sees every ATen call (private module
# ``torch.utils._python_dispatch``; torch's docs on extending point to it), 2.11-2.14.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpOverload", "TorchDispatchMode", "boxed_codegen", "fake_tensor_types"]

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
