"""What zero3 keeps about one sharded parameter (``ShardedParam``) and one module (``ModuleState``).

A parameter is in one of these states (``ShardState``), changed only through
``ShardedParam.transition``, which refuses any other change:

```
             set_requires_gradient_sync(False)
  SHARDED  ───────────────────────────────────►  ACCUMULATING   full gradients go to the sink
     ▲  ▲  ◄───────────────────────────────────      │          (no reduce-scatter)
     │  │       set_requires_gradient_sync(True)     │ keep_gathered=True
     │  │                                            ▼
     │  └──────────────────────────────────────  KEPT_GATHERED  the full parameter is kept;
     │       set_requires_gradient_sync(True):                  its .grad accumulates
     │       reduce-scatter, free the full tensor
     └── (keep_gathered=True straight from SHARDED)

  SHARDED ◄──► GATHERED   z3.gathered(model): the full parameter (no gradient) is read, for
                          inference; writes to it reach the shard
  SHARDED ◄──► LOADING    a loader works on the shards: reading module.weight gives the sharded
                          parameter itself, assigning one adopts its values (integrations/hf)
```
Where the shard's values are (in memory or in an offload store) is the offload record's own state
(``offload.params.Residency``).
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .._torch.dtensor import local_shard
from .spec import ShardSpec


class ShardState(enum.Enum):
    SHARDED = "sharded"
    ACCUMULATING = "accumulating"
    KEPT_GATHERED = "kept_gathered"
    GATHERED = "gathered"
    LOADING = "loading"


_ALLOWED = {
    ShardState.SHARDED: {
        ShardState.ACCUMULATING,
        ShardState.KEPT_GATHERED,
        ShardState.GATHERED,
        ShardState.LOADING,
    },
    ShardState.ACCUMULATING: {ShardState.SHARDED, ShardState.KEPT_GATHERED},
    ShardState.KEPT_GATHERED: {ShardState.SHARDED},
    ShardState.GATHERED: {ShardState.SHARDED},
    ShardState.LOADING: {ShardState.SHARDED},
}
_HOLDS_FULL = (ShardState.KEPT_GATHERED, ShardState.GATHERED)

_STATE_ATTR = "_zero3_state"
_KEPT_ATTR = "_zero3_kept_of"  # on a kept full parameter: its ShardedParam


@dataclass(eq=False)
class ShardedParam:
    """Everything zero3 keeps about one sharded parameter (FSDP2's ``FSDPParam`` plays this role).

    Reached through ``state_of(param)``. The parameter itself stays an ordinary ``nn.Parameter``
    holding a ``DTensor``; this record is attached to it and re-attached when ``model.to()`` or
    ``model.half()`` swap the parameter's contents.
    """

    param_id: int  # stable across ranks and model instances: see ``param_id_of``
    spec: ShardSpec
    rank: int  # this rank's index in the shard group: which rows it holds
    param: nn.Parameter = field(repr=False)
    root: Any = field(default=None, repr=False)  # runtime.root.Zero3Runtime of its shard() call
    state: ShardState = ShardState.SHARDED
    offload: Any = field(default=None, repr=False)  # offload.params.OffloadedShard
    # ACCUMULATING / KEPT_GATHERED: the zero-strided leaf receiving full gradients
    grad_sink: torch.Tensor | None = field(default=None, repr=False)
    # KEPT_GATHERED: the full parameter, in the shard's dtype; its .grad accumulates.
    # GATHERED: the full parameter in the compute dtype, without gradient
    kept_full: torch.Tensor | None = field(default=None, repr=False)
    # a tensor-parallel DTensor parameter: its TP layout (``sharding.layout``); None otherwise
    layout: Any = field(default=None, repr=False)
    # in-place scalings (divide, number) asked of param.grad while its gradient was pending
    # unreduced, applied when it is reduced (``frontend/pending.py``)
    pending_scalings: list = field(default_factory=list)
    # held by more than one module attribute (an embedding tied to the output head)
    tied: bool = False

    @property
    def fqn(self) -> str:
        return self.spec.fqn

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The tensor zero3 gathers: the parameter's full shape, or its TP-local shape."""
        return self.spec.shape

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's shape as ``DTensor`` (the TP-global shape under TP)."""
        return self.spec.shape if self.layout is None else self.layout.shape

    @property
    def requires_sync(self) -> bool:
        return self.state is ShardState.SHARDED

    def transition(self, new: ShardState) -> None:
        """Move to ``new``; anything but the changes drawn in the module docstring is a bug."""
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise AssertionError(
                f"zero3: {self.fqn!r} cannot go from {self.state.name} to {new.name}"
            )
        if new in _HOLDS_FULL:
            assert self.kept_full is not None, "keep the full parameter before the transition"
        if self.state in _HOLDS_FULL:
            assert self.kept_full is None, "release the full parameter before the transition"
        if new is ShardState.KEPT_GATHERED:  # found among a graph's inputs: kept_state_of
            self.kept_full.__dict__[_KEPT_ATTR] = self
        self.state = new

    def local(self) -> torch.Tensor:
        """This rank's shard (a plain tensor sharing the parameter's storage; no gradient
        flows back to the parameter where none came: ``_torch.dtensor.local_shard``)."""
        return local_shard(self.param)

    def attach(self, param: nn.Parameter) -> None:
        self.param = param
        param.__dict__[_STATE_ATTR] = self

    def __reduce__(self):
        # pickling a sharded model rebuilds fresh states (frontend/pickling.py)
        return (_detached_state, ())


def _detached_state() -> None:
    return None


def param_id_of(fqn: str, full_shape) -> int:
    """The stable id of a parameter: 31 bits of its name and shape. Equal on every rank and in
    every instance of the same model (so compiled code is shared); the shard input tells
    instances apart where it matters (dedupe)."""
    return zlib.crc32(f"{fqn}:{list(full_shape)}".encode()) & 0x7FFFFFFF


def state_of(param: Any) -> ShardedParam | None:
    """The ``ShardedParam`` of a sharded parameter, None for anything else."""
    if not isinstance(param, torch.Tensor):
        return None
    state = getattr(param, "__dict__", {}).get(_STATE_ATTR)
    return state if isinstance(state, ShardedParam) and state.param is param else None


def kept_state_of(tensor: Any) -> ShardedParam | None:
    """The ``ShardedParam`` whose kept full parameter (``KEPT_GATHERED``) ``tensor`` is, None for
    anything else (the runtime gate gives it no gradient where eager would leave none)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    state = getattr(tensor, "__dict__", {}).get(_KEPT_ATTR)
    if not isinstance(state, ShardedParam) or state.kept_full is not tensor:
        return None
    return state if state.state is ShardState.KEPT_GATHERED else None


def is_sharded(param: Any) -> bool:
    return state_of(param) is not None


# --------------------------------------------------------------------------- per-module state

_MODULE_ATTR = "_zero3"


@dataclass(eq=False)
class ModuleState:
    """What zero3 keeps about one module of a sharded model (in its ``__dict__``).

    params: the module's own sharded parameters by attribute name.
    scope: full parameters gathered for the running forward of an enclosing leaf module
        (``set_leaf_modules``), by attribute name; None outside of one.
    root: the runtime of the ``shard()`` call (``runtime.root.Zero3Runtime``), shared.
    prefix: this module's qualified name under the root.
    """

    params: dict[str, ShardedParam] = field(default_factory=dict)
    scope: dict[str, torch.Tensor] | None = None
    root: Any = None
    prefix: str = ""

    def __reduce__(self):
        return (_detached_state, ())


def module_state(module: Any) -> ModuleState | None:
    state = getattr(module, "__dict__", {}).get(_MODULE_ATTR)
    return state if isinstance(state, ModuleState) else None


def set_module_state(module: Any, state: ModuleState) -> None:
    module.__dict__[_MODULE_ATTR] = state
