"""The only place ``node.meta`` / ``gm.meta`` keys of this package are defined (all namespaced
``zero3_*``). (Named for FX node metadata, not for the ``meta`` device.)"""

from __future__ import annotations

from ..collectives import roles

# the roles nodes are tagged with (``meta[ROLE]``): the steps of the collective schemes
ROLE_ALL_GATHER = roles.ALL_GATHER
ROLE_GATHER_COPY_IN = roles.GATHER_COPY_IN
ROLE_GATHER_COPY_OUT = roles.GATHER_COPY_OUT
ROLE_GATHER_WAIT = roles.GATHER_WAIT
ROLE_GUARD = roles.GUARD
ROLE_REDUCE_COPY_IN = roles.REDUCE_COPY_IN
ROLE_REDUCE_COPY_OUT = roles.REDUCE_COPY_OUT
ROLE_REDUCE_SCATTER = roles.REDUCE_SCATTER
ROLE_REDUCE_WAIT = roles.REDUCE_WAIT
ROLE_RELOAD = roles.RELOAD
ROLE_RELOAD_WAIT = roles.RELOAD_WAIT
ROLE_REPLICA_ALL_REDUCE = roles.REPLICA_ALL_REDUCE
ROLE_REPLICA_WAIT = roles.REPLICA_WAIT

# Role of a node created by the passes; one of the ROLE_* values above.
ROLE = "zero3_role"
# Index of the bucket (per graph and per kind of collective) the node belongs to.
BUCKET = "zero3_bucket"
# Names of the parameters a collective node carries (tuple of str).
PARAMS = "zero3_params"
# On a collective node the passes created: what its group is on every rank ("shard",
# "replicate"), for signatures compared across ranks whose group names differ.
GROUP_ROLE = "zero3_group_role"
# On a compressed collective whose uncompressed bytes are not its bucket's: what it would carry
# uncompressed (the reports' "compressed from").
FULL_BYTES = "zero3_full_bytes"
# Set on joint-graph nodes computed from gathered parameters alone (recomputed in backward).
PARAM_DERIVED = "zero3_param_derived"

# On a partitioned forward GraphModule's ``meta``: how many of its outputs are the user's
# (the rest are saved for backward).
NUM_USER_OUTPUTS = "zero3_num_user_outputs"
# On a scheduled GraphModule's ``meta``: the ``buckets.BucketRecord`` of every bucket lowered.
BUCKETS = "zero3_buckets"
