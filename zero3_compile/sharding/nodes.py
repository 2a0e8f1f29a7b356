"""The node-local groups of a shard group: where ZeRO++'s secondary shards (hpZ) are gathered, and
where a quantized gradient reduction (qgZ) sums exactly before it crosses nodes.

A node's ranks are consecutive global ranks (``torchrun`` numbers them so), and so are the
members of a shard group that live on one node: the shard group's ranks, split into runs of
``ranks_per_node``. Each run is one node group; a rank's index in it says which slice of the
gathered parameters it keeps (``compiler/secondary.py``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch.distributed as dist

from .._torch.c10d import resolve_group


@dataclass(frozen=True)
class NodeGroup:
    name: str  # the process group's name, as graphs name it
    size: int  # ranks of the shard group on this node
    index: int  # this rank's index among them
    shard_group: str  # the shard group it is a part of


_GROUPS: dict[tuple[str, int], NodeGroup] = {}
_ACROSS: dict[tuple[str, int], NodeGroup] = {}
_SHARD_GROUP_OF: dict[str, str] = {}


def ranks_per_node(secondary_shard: str | int) -> int:
    """The ``secondary_shard`` option as a count of ranks: ``"node"`` reads torchrun's
    ``LOCAL_WORLD_SIZE``; an int is taken as it is (a node's share of the shard group)."""
    if secondary_shard != "node":
        return int(secondary_shard)
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if not value:
        raise ValueError(
            "zero3: option secondary_shard='node' needs LOCAL_WORLD_SIZE (set by torchrun) to "
            "know how many ranks share a node; launch with torchrun, or give the count: "
            "secondary_shard=<ranks per node>"
        )
    return int(value)


def node_group(shard_group: str, size: int) -> NodeGroup:
    """This rank's node group of the shard group named ``shard_group``, created on first use by
    the ranks of that node only (the other nodes create theirs at the same point of their
    compile: every rank of a shard group compiles the same graphs)."""
    key = (shard_group, size)
    if key in _GROUPS:
        return _GROUPS[key]
    ranks = dist.get_process_group_ranks(resolve_group(shard_group))
    if size < 2 or len(ranks) % size or size >= len(ranks):
        raise ValueError(
            f"zero3: option secondary_shard={size} must divide the shard group's {len(ranks)} "
            "ranks into two or more nodes of two or more ranks (with one node, backward's "
            "all-gathers already stay on it; drop the option)"
        )
    position = ranks.index(dist.get_rank())
    first = position - position % size
    members = ranks[first : first + size]
    group = dist.new_group(members, use_local_synchronization=True)
    _GROUPS[key] = NodeGroup(group.group_name, size, position - first, shard_group)
    _SHARD_GROUP_OF[group.group_name] = shard_group
    return _GROUPS[key]


def shard_group_of(group: str) -> str:
    """The shard group a node group belongs to; any other group is its own."""
    return _SHARD_GROUP_OF.get(group, group)


def across_nodes_group(shard_group: str, size: int) -> NodeGroup:
    """This rank's group of the shard group's ranks with its index on every node (one per node:
    ``size`` ranks per node, as ``node_group``); ``index`` is this rank's node. Created on first
    use by its members only, at the same point of every rank's compile."""
    key = (shard_group, size)
    if key in _ACROSS:
        return _ACROSS[key]
    node = node_group(shard_group, size)  # checks the layout
    ranks = dist.get_process_group_ranks(resolve_group(shard_group))
    members = ranks[node.index :: size]
    group = dist.new_group(members, use_local_synchronization=True)
    position = ranks.index(dist.get_rank())
    _ACROSS[key] = NodeGroup(group.group_name, len(members), position // size, shard_group)
    _SHARD_GROUP_OF[group.group_name] = shard_group
    return _ACROSS[key]


def reduction_node_size(shard_group: str, secondary_shard: str | int | None) -> int | None:
    """Ranks of the shard group per node for a quantized gradient reduction, None where it spans
    one node or the nodes cannot be told: the ``secondary_shard`` option's count where it is set;
    else from torchrun's ``LOCAL_WORLD_SIZE`` (global rank // it is the node), where the shard
    group's ranks fall into equal consecutive runs of two or more per node (a data-parallel
    group strided across nodes by tensor parallelism has one rank per node: None)."""
    try:
        ranks = dist.get_process_group_ranks(resolve_group(shard_group))
    except (RuntimeError, ValueError, KeyError, AttributeError):  # a graph read offline
        return None
    if secondary_shard is not None:
        size = ranks_per_node(secondary_shard)
    else:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not local.isdigit() or int(local) < 2:
            return None
        nodes = [rank // int(local) for rank in ranks]
        runs = [len(list(run)) for _, run in itertools.groupby(nodes)]
        if len(runs) != len(set(nodes)) or len(set(runs)) != 1:
            return None  # a node's ranks not consecutive in the group, or unequal counts
        size = runs[0]
    if size < 2 or size >= len(ranks) or len(ranks) % size:
        return None
    return size
