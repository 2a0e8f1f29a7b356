"""``Zero3Module``: what every module of a sharded model is, besides its own class.

FSDP2's ``FSDPModule`` plays this role: integrations (a ``Trainer`` subclass, torch's pipelining
stages) recognise a sharded model with ``isinstance(module, z3.Zero3Module)`` and call its
methods instead of reaching into private state.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn as nn

from ..sharding.spec import ShardSpec
from ..sharding.state import ShardedParam, module_state


class Zero3Module:
    """Mixed into the generated class of every module of a sharded model (``z3.shard``).

    Example:
        ```python
        z3.shard(model)
        assert isinstance(model, z3.Zero3Module)
        model.set_requires_gradient_sync(False)  # = z3.set_requires_gradient_sync(model, False)
        spec = model.shard_spec("weight")  # full shape, groups, the rows of each rank
        ```
    """

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, keep_gathered: bool = False
    ) -> None:
        """``z3.set_requires_gradient_sync`` on this module and every module below it."""
        from .accumulation import set_requires_gradient_sync

        set_requires_gradient_sync(self, requires_gradient_sync, keep_gathered=keep_gathered)

    def sharded_parameters(self, recurse: bool = True) -> Iterator[tuple[str, ShardedParam]]:
        """(name, state) of each sharded parameter, each tied parameter once."""
        seen = set()
        modules = self.named_modules() if recurse else [("", self)]
        for prefix, module in modules:
            state = module_state(module)
            if state is None:
                continue
            for attr, param_state in state.params.items():
                if id(param_state) in seen:
                    continue
                seen.add(id(param_state))
                yield (f"{prefix}.{attr}" if prefix else attr), param_state

    def shard_spec(self, name: str) -> ShardSpec:
        """The ``ShardSpec`` of the parameter ``name`` (as ``named_parameters`` spells it)."""
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name) if owner_name else self
        state = module_state(owner)
        if state is None or attr not in state.params:
            raise KeyError(f"zero3: {name!r} is not a sharded parameter of this module")
        return state.params[attr].spec

    @property
    def zero3_runtime(self):
        """The runtime of the ``shard()`` call this module belongs to (``runtime.root``)."""
        return module_state(self).root


def sharded_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Zero3Module)]
