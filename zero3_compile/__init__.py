"""zero3_compile: ZeRO stage 3 (fully sharded data parallel) as a torch.compile backend.

model = zero3_compile.shard(model)                 # every parameter becomes a 1/N shard
cmodel = torch.compile(model, backend="zero3")     # options={...}: see zero3_compile.Options

The public API, nothing else. The layers underneath, each importing only those before it:
sharding (what a sharded parameter is) -> offload -> runtime (the cross-rank check, a model's
runtime) -> collectives (schemes, ops) -> compiler (backend, passes) -> frontend (shard, module
classes) -> io (checkpoints, state dicts); tools (inspection, estimates) and hf (the Hugging Face
integration: ``from zero3_compile import hf``) import the core, never the reverse.
"""

from .collectives import ops as _ops  # noqa: F401  (registers the zero3:: operators)
from .compiler.backend import register as _register
from .compiler.backend import zero3_backend
from .compiler.options import Options
from .compiler.recording import record_graphs
from .frontend.accumulation import set_requires_gradient_sync
from .frontend.gathered import gathered
from .frontend.leaves import set_leaf_modules
from .frontend.mixed_precision import MixedPrecision
from .frontend.module import Zero3Module
from .frontend.regions import compile_once
from .frontend.shard import shard
from .io.checkpoint import (
    CheckpointCorruptError,
    PeerLostError,
    load_checkpoint,
    load_rank_state,
    save_checkpoint,
    verify_checkpoint,
)
from .io.materialize import materialize
from .io.state_dict import full_state_dict, load_full_state_dict, save_full_state_dict
from .offload import Offload, OffloadError, offload_optimizer, offload_states, reload_states
from .runtime.guard import CollectiveMismatchError
from .tools.estimate import estimate_memory
from .tools.inspect import explain

_register()

__all__ = [
    "CheckpointCorruptError",
    "CollectiveMismatchError",
    "MixedPrecision",
    "Offload",
    "OffloadError",
    "Options",
    "PeerLostError",
    "Zero3Module",
    "compile_once",
    "estimate_memory",
    "explain",
    "full_state_dict",
    "gathered",
    "load_checkpoint",
    "load_full_state_dict",
    "load_rank_state",
    "materialize",
    "offload_optimizer",
    "offload_states",
    "record_graphs",
    "reload_states",
    "save_checkpoint",
    "save_full_state_dict",
    "set_leaf_modules",
    "set_requires_gradient_sync",
    "shard",
    "verify_checkpoint",
    "zero3_backend",
]
__version__ = "0.1.0"
