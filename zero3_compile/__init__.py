"""zero3_compile: ZeRO stage 3 (fully sharded data parallel) as a torch.compile backend.

model = zero3_compile.shard(model)                 # every parameter becomes a 1/N shard
cmodel = torch.compile(model, backend="zero3")     # options={...}: see zero3_compile.Options
"""

from . import ops as _ops  # noqa: F401  (registers the zero3:: operators)
from .backend import register as _register
from .backend import zero3_backend
from .options import Options
from .shard import shard
from .state_dict import full_state_dict, load_full_state_dict

_register()

__all__ = ["Options", "full_state_dict", "load_full_state_dict", "shard", "zero3_backend"]
__version__ = "0.1.0"
