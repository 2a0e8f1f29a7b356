"""``GatheredParameters``: DeepSpeed's context manager over ``z3.gathered``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.nn as nn

from ..frontend.gathered import gathered


class GatheredParameters:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters``: the given parameters gathered whole
    for the block (collective on entry and exit: every rank of the model's mesh enters it).

    params: one parameter, an iterable of them (``module.parameters()``), or a module; tensors
        that are no sharded parameter are ignored, as DeepSpeed ignores non-ZeRO parameters.
        ``[layer.weight]`` works but reads (gathers) the weight once more to name it:
        ``layer.parameters(recurse=False)`` does not.
    modifier_rank: the global rank whose writes every rank keeps on exit (its copies are
        broadcast); None: writes must be the same on every rank, otherwise every rank raises on
        exit and the changes are discarded (DeepSpeed drops them silently).
    fwd_module: accepted for DeepSpeed's signature; not needed (a gathered parameter is read
        from the module's own attribute).
    enabled: False makes the block do nothing.

    Example:
        ```python
        from zero3_compile.deepspeed import GatheredParameters

        with GatheredParameters(model.embed.parameters(), modifier_rank=0):
            if dist.get_rank() == 0:
                model.embed.weight[:100].copy_(pretrained_rows)
        ```
    """

    def __init__(
        self,
        params: nn.Module | torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ):
        if not isinstance(params, (nn.Module, torch.Tensor)):
            params = list(params)
        self.params = params
        self.modifier_rank = modifier_rank
        self.enabled = bool(enabled)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        if not self.enabled:
            return
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(gathered(self.params, modifier_rank=self.modifier_rank))

    def __exit__(self, *exc) -> bool:
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        return bool(stack.__exit__(*exc))
