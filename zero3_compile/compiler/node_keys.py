"""The only place ``node.meta`` keys of this package are defined (all namespaced ``zero3_*``).

(Named for FX node metadata, not for the ``meta`` device.)
"""

from __future__ import annotations

# Role of a node created by the passes; one of the ROLE_* values below.
ROLE = "zero3_role"
# Index of the bucket (per graph and per kind of collective) the node belongs to.
BUCKET = "zero3_bucket"
# Names of the parameters a collective node carries (tuple of str).
PARAMS = "zero3_params"
# Set on joint-graph nodes computed from gathered parameters alone (recomputed in backward).
PARAM_DERIVED = "zero3_param_derived"

ROLE_GUARD = "guard"
ROLE_RELOAD = "reload"
ROLE_RELOAD_WAIT = "reload_wait"
ROLE_GATHER_COPY_IN = "gather_copy_in"
ROLE_ALL_GATHER = "all_gather"
ROLE_GATHER_WAIT = "gather_wait"
ROLE_GATHER_COPY_OUT = "gather_copy_out"
ROLE_REDUCE_COPY_IN = "reduce_copy_in"
ROLE_REDUCE_SCATTER = "reduce_scatter"
ROLE_REDUCE_WAIT = "reduce_wait"
ROLE_REDUCE_COPY_OUT = "reduce_copy_out"
ROLE_REPLICA_ALL_REDUCE = "replica_all_reduce"
ROLE_REPLICA_WAIT = "replica_wait"

# On a partitioned forward GraphModule's ``meta``: how many of its outputs are the user's
# (the rest are saved for backward).
NUM_USER_OUTPUTS = "zero3_num_user_outputs"
