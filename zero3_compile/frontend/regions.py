"""``compile_once(blocks)``: a whole-model compile that compiles each kind of block once.

Marks the forward of the blocks' (generated, ``classes.py``) class as a nested compile region
(``torch.compiler.nested_compile_region``): dynamo traces the first block and calls that body for
the others, AOTAutograd and Inductor compile it once, and the backend lifts the parameters'
gathers out of the body into the model's graph (``compiler/passes/regions.py``), where they are
bucketed and prefetched across block boundaries as in an inlined model. Eagerly nothing changes.

Only the generated class of a sharded module is changed: the user's class, an unsharded copy of
the model and other backends' compiles do not see the mark. A user who decorates a block's own
``forward`` with ``torch.compiler.nested_compile_region`` gets the same compile.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from .._torch.dynamo import nested_regions_take_dtensor_inputs
from .classes import base_class, is_sharded_module

_MARK = "_zero3_compile_once"


def compile_once(blocks: nn.Module | Iterable[nn.Module]) -> None:
    """Compile each distinct kind of block among ``blocks`` once (within a whole-model
    ``torch.compile(model, backend="zero3")``) instead of once per block.

    ``blocks``: a block, or an iterable of blocks (``model.model.layers``); each must belong to
    a model already passed to ``zero3_compile.shard``. Idempotent.

    Example:
        ```python
        z3.shard(model)
        z3.compile_once(model.model.layers)  # each kind of decoder layer compiled once
        step_model = torch.compile(model, backend="zero3")  # the whole model's schedule
        ```
    """
    modules = [blocks] if _is_single(blocks) else list(blocks)
    if not modules:
        raise ValueError("zero3: compile_once() got no blocks")
    mark = getattr(torch.compiler, "nested_compile_region", None)
    if mark is None:
        raise RuntimeError(
            f"zero3: compile_once needs torch.compiler.nested_compile_region (torch "
            f"{torch.__version__} has none); upgrade torch, or compile the whole model as it is"
        )
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"zero3: compile_once() takes modules, got {type(module).__name__}")
        if not is_sharded_module(module):
            raise ValueError(
                f"zero3: compile_once() got a {type(module).__name__} that is not sharded; call "
                "zero3_compile.shard(model) first, then compile_once(<its blocks>)"
            )
    if not nested_regions_take_dtensor_inputs():
        raise RuntimeError(
            f"zero3: compile_once needs torch >= 2.13 (the nested compile regions of torch "
            f"{torch.__version__} cannot take sharded parameters); compile the whole model "
            "without it, or each block with block.compile(backend='zero3')"
        )
    for module in modules:
        cls = type(module)
        if cls.__dict__.get(_MARK):
            continue
        if cls is base_class(module):  # pragma: no cover - sharded modules have generated classes
            raise AssertionError("zero3: a sharded module without its generated class")
        cls.forward = mark(_forward_of(base_class(module)))
        setattr(cls, _MARK, True)


def _is_single(blocks) -> bool:
    return isinstance(blocks, nn.Module) and not isinstance(
        blocks, (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    )


def _forward_of(base: type):
    """A function of its own that calls ``base.forward`` (the mark is set on the function it
    wraps: the user's ``forward`` stays unmarked)."""
    forward = base.forward

    def region(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    region.__name__ = region.__qualname__ = f"{base.__name__}.forward"
    return region


__all__ = ["compile_once"]
