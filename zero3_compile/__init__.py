"""zero3_compile: ZeRO stage 3 (fully sharded data parallel) as a torch.compile backend.

model = zero3_compile.shard(model)                 # every parameter becomes a 1/N shard
cmodel = torch.compile(model, backend="zero3")     # options={...}: see zero3_compile.Options
"""

from . import ops as _ops  # noqa: F401  (registers the zero3:: operators)
from .accumulation import set_requires_gradient_sync
from .backend import register as _register
from .backend import zero3_backend
from .checkpoint import (
    CheckpointCorruptError,
    PeerLostError,
    load_checkpoint,
    load_rank_state,
    save_checkpoint,
    verify_checkpoint,
)
from .estimate import estimate_memory
from .guard import CollectiveMismatchError
from .inspect import explain
from .materialize import materialize
from .mixed_precision import MixedPrecision
from .offload import Offload, OffloadError, offload_optimizer
from .options import Options
from .recording import record_graphs
from .shard import set_leaf_modules, shard
from .state_dict import full_state_dict, load_full_state_dict, save_full_state_dict

_register()

__all__ = [
    "CheckpointCorruptError",
    "CollectiveMismatchError",
    "MixedPrecision",
    "Offload",
    "OffloadError",
    "Options",
    "PeerLostError",
    "estimate_memory",
    "explain",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "load_rank_state",
    "materialize",
    "offload_optimizer",
    "record_graphs",
    "save_checkpoint",
    "save_full_state_dict",
    "set_leaf_modules",
    "set_requires_gradient_sync",
    "shard",
    "verify_checkpoint",
    "zero3_backend",
]
__version__ = "0.1.0"
