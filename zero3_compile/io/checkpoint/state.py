"""What a checkpoint saves and loads: the model's and optimizer's state dicts, read from the
shards (never gathered), offloaded values read or written one at a time, and an optimizer that
has not stepped left without state."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from ..._torch.checkpoint import no_optimizer_state_init
from ..._torch.modules import own_parameters
from ...frontend.loading import loading
from ...offload.deferred import deferred_reads, materialized
from ...offload.incoming import incoming_loads
from ...sharding.state import ShardState, module_state
from ..stages import StageModules


class ReadingPlanner(DefaultSavePlanner):
    """Offloaded values are read right before they are written (the writer asks for one
    tensor at a time), so a save never holds the offloaded state at once."""

    def resolve_data(self, write_item):
        return materialized(super().resolve_data(write_item))


def state_dicts(
    stages: StageModules,
    optimizer: torch.optim.Optimizer | None,
    *,
    for_save: bool = False,
    unstepped: bool = False,
) -> dict[str, Any]:
    """The state dicts DCP saves from or loads into. ``unstepped`` (a load of a checkpoint saved
    before the optimizer's first step): the optimizer's parameter groups only."""
    # torch's state-dict helpers find parameters by walking attributes (``getattr(module,
    # "weight")``): with the shards visible that reads the sharded parameters, not a gather each.
    # For a save, offloaded values come as tensors read on use (``offload/deferred.py``); for a
    # load, as tensors written to their stores as DCP reads them (``offload/incoming.py``)
    deferred = deferred_reads() if for_save else incoming_loads()
    access = shard_reads(stages) if for_save else shard_access(stages)
    with access, deferred, no_optimizer_state_init(for_save or unstepped):
        if optimizer is None:
            state = {"model": get_model_state_dict(stages.root, options=stages.options)}
        else:
            model_state, optim_state = get_state_dict(
                stages.root, optimizer, options=stages.options
            )
            if unstepped:  # flattened: "state.<fqn>.<key>", "param_groups.<fqn>.<key>"
                optim_state = {k: v for k, v in optim_state.items() if not k.startswith("state.")}
            state = {"model": model_state, "optim": optim_state}
    return stages.stored(state)


def without_optimizer_state(metadata) -> bool:
    """Whether a checkpoint holds the optimizer's parameter groups but no state (saved before
    its first step)."""
    keys = metadata.state_dict_metadata
    return any(k.startswith("optim.param_groups.") for k in keys) and not any(
        k.startswith("optim.state.") for k in keys
    )


@contextlib.contextmanager
def shard_reads(stages: StageModules):
    """For a save: reading ``module.<param>`` gives the sharded parameter (as ``loading()``
    does), also while gradient sync is off (the shards hold the values of the last step; the
    kept full parameters of ``keep_gathered`` equal them). Inside ``z3.gathered(model)`` the
    shards may not hold the writes made there yet: refused."""
    scoped = []
    for root in stages.modules:
        for module in root.modules():
            state = module_state(module)
            if state is None:
                continue
            for param_state in state.params.values():
                if param_state.state in (ShardState.GATHERED, ShardState.LOADING):
                    raise RuntimeError(
                        f"zero3: save_checkpoint reads the shards, and {param_state.fqn!r} is "
                        f"{param_state.state.name} (inside z3.gathered(model) or a load): save "
                        "after that block"
                    )
            if state.scope is not None:
                raise RuntimeError(
                    "zero3: save_checkpoint was called inside a leaf module's forward; save "
                    "between steps"
                )
            scoped.append((module, state))
    try:
        for module, state in scoped:
            state.scope = {attr: own_parameters(module)[attr] for attr in state.params}
        yield
    finally:
        for _, state in scoped:
            state.scope = None


@contextlib.contextmanager
def shard_access(stages: StageModules):
    with contextlib.ExitStack() as stack:
        for module in stages.modules:
            stack.enter_context(loading(module))
        yield
