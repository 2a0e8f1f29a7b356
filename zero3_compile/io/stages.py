"""A rank's pipeline stage modules as one model for a checkpoint: ``StageModules``.

With pipeline parallelism each rank holds some stages of the model, cut from it with the whole
model's module names kept (torchtitan's way: ``layers.3`` stays ``layers.3``). A checkpoint saved
from every rank's stages then holds the whole model under its own names, so it loads at another
number of stages, data- or tensor-parallel degree, or into the unsharded model. torch's
state-dict helpers take one module: the stages go under a transient root (``0.``, ``1.``, ...
prefixes) and the prefixes are taken off the keys the checkpoint stores. ``save_checkpoint``
stores the optimizer state flattened (one entry per parameter and key, torchtitan's
``StateDictOptions(flatten_optimizer_state_dict=True)``), for one module too, so that each rank
loads the entries of the parameters it holds, whichever stages it runs; the layout is recognised
on load by the checkpoint's keys (a checkpoint stored by parameter group, as plain DCP does,
loads into one module).
"""

from __future__ import annotations

import re
from typing import Any

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions


class StageModules:
    """``model`` (a module, or a list of this rank's stage modules) as torch's helpers take it."""

    def __init__(self, model: nn.Module | list[nn.Module], flatten: bool = False):
        if isinstance(model, nn.Module):
            self.modules, self.root = [model], model
        else:
            self.modules = list(model)
            if not self.modules or not all(isinstance(m, nn.Module) for m in self.modules):
                raise TypeError(
                    "zero3: a checkpoint's model is an nn.Module or a list of this rank's "
                    f"pipeline stage modules, got {model!r}"
                )
            self.root = nn.Module()
            for index, module in enumerate(self.modules):
                self.root.add_module(str(index), module)
        self.prefixed = self.root is not model
        self.flatten = flatten or self.prefixed
        self._original: dict[str, str] = {}  # stored key -> the root's key

    @property
    def options(self) -> StateDictOptions | None:
        return StateDictOptions(flatten_optimizer_state_dict=True) if self.flatten else None

    def stored(self, state: dict[str, Any]) -> dict[str, Any]:
        """The root's state dicts ("model", "optim") under the whole model's names."""
        if not self.prefixed:
            return state
        out = dict(state)
        for part in ("model", "optim"):
            if part in state:
                out[part] = {self._strip(key): value for key, value in state[part].items()}
        return out

    def root_state(self, stored: dict[str, Any]) -> dict[str, Any]:
        """``stored`` back under the root's names (after a load filled it)."""
        if not self.prefixed:
            return stored
        out = dict(stored)
        for part in ("model", "optim"):
            if part in stored:
                out[part] = {self._original[key]: value for key, value in stored[part].items()}
        return out

    def _strip(self, key: str) -> str:
        # "0.layers.3.w" (model) or "state.0.layers.3.w.exp_avg" / "param_groups.0...." (optim)
        head, _, rest = key.partition(".")
        if head in ("state", "param_groups"):
            stripped = f"{head}.{rest.partition('.')[2]}"
        else:
            stripped = rest
        if stripped in self._original:
            raise ValueError(
                f"zero3: two pipeline stage modules of this rank both hold {stripped!r}; each "
                "parameter name must belong to one stage"
            )
        self._original[stripped] = key
        return stripped


def is_flattened(metadata) -> bool:
    """Whether a checkpoint's optimizer state is stored flattened (see the module docstring):
    its parameter groups are entries per parameter, not lists naming their parameters
    (``optim.param_groups.<i>.params``)."""
    keys = [k for k in metadata.state_dict_metadata if k.startswith("optim.param_groups.")]
    return bool(keys) and not any(_GROUP_LIST.fullmatch(k) for k in keys)


_GROUP_LIST = re.compile(r"optim\.param_groups\.\d+\.params(\.\d+)?")
