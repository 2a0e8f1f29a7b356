"""The roles of the steps of a collective scheme (``schemes.py``), as the lowering passes tag the
nodes they create (``node.meta["zero3_role"]``) and the reports read them."""

GUARD = "guard"
RELOAD = "reload"
RELOAD_WAIT = "reload_wait"
GATHER_COPY_IN = "gather_copy_in"
ALL_GATHER = "all_gather"
GATHER_WAIT = "gather_wait"
GATHER_COPY_OUT = "gather_copy_out"
REDUCE_COPY_IN = "reduce_copy_in"
REDUCE_SCATTER = "reduce_scatter"
REDUCE_WAIT = "reduce_wait"
REDUCE_COPY_OUT = "reduce_copy_out"
REPLICA_ALL_REDUCE = "replica_all_reduce"
REPLICA_WAIT = "replica_wait"

# what a collective's group is, the same on every rank (group names differ from row to row of a
# mesh): the signatures and the cross-rank check compare these
GROUP_SHARD = "shard"
GROUP_REPLICATE = "replicate"
GROUP_NODE = "node"  # a node's ranks of the shard group (hpZ's secondary shards, qgZ's first sum)
GROUP_ACROSS_NODES = "across_nodes"  # the shard group's ranks of one index on every node (qgZ)
