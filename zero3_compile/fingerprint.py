"""Cross-rank check that every rank compiled the same collectives, in the same order.

A rank whose graph issues different collectives than its peers (another input shape made
``torch.compile`` recompile on that rank only, a rank-dependent branch in the model) would
otherwise hang every rank in a mismatched collective, or silently mix unrelated buffers. When a
graph with collectives is compiled, each rank publishes a digest of its collective sequence in
the process group's store (not through a collective, which could itself mismatch) and waits for
its peers' digest of the same compile sequence number.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections import defaultdict

import torch.distributed as dist
import torch.fx as fx

from .compat import ALL_GATHER, REDUCE_SCATTER, default_store, group_backend, store_wait

log = logging.getLogger(__name__)

_sequence: dict[str, int] = defaultdict(int)


def collective_signature(graph: fx.Graph) -> list[tuple]:
    """(kind, group, world size, elements, dtype) for every collective, in graph order."""
    signature = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (ALL_GATHER, REDUCE_SCATTER):
            continue
        tensor = node.args[0].meta["val"]
        if node.target is ALL_GATHER:
            kind, world, group = "all_gather", node.args[1], node.args[2]
        else:
            kind, world, group = f"reduce_scatter_{node.args[1]}", node.args[2], node.args[3]
        signature.append((kind, str(group), int(world), int(tensor.numel()), str(tensor.dtype)))
    return signature


class CollectiveMismatchError(RuntimeError):
    pass


def check_same_on_all_ranks(graph: fx.Graph, label: str, timeout_s: float) -> None:
    """Raise ``CollectiveMismatchError`` unless every rank of the group compiled ``graph`` alike."""
    signature = collective_signature(graph)
    if not signature:
        return
    group_name = signature[0][1]
    group = dist.distributed_c10d._resolve_process_group(group_name)
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1 or group_backend(group) == "fake":
        return
    store = default_store()
    if store is None:
        log.warning("zero3: no store available; skipping the cross-rank collective check")
        return
    sequence = _sequence[group_name]
    _sequence[group_name] += 1
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()[:16]
    me = dist.get_rank()
    prefix = f"zero3/fingerprint/{group_name}/{sequence}/"
    store.set(
        prefix + str(me), json.dumps({"digest": digest, "label": label, "signature": signature})
    )
    try:
        store_wait(store, [prefix + str(r) for r in ranks], timeout_s)
    except Exception as error:  # DistStoreError (timeout) or a closed store (a peer died)
        missing = [r for r in ranks if not _has_key(store, prefix + str(r))]
        raise CollectiveMismatchError(
            f"zero3: rank {me} compiled graph #{sequence} ({label}, {len(signature)} collectives) "
            f"but rank(s) {missing} did not compile a graph within {timeout_s:.0f}s. They are "
            "probably running an already compiled graph, so their collectives no longer match: "
            "torch.compile recompiled on this rank only, typically because its inputs had another "
            "shape or dtype. Give every rank inputs of the same shapes (pad or drop the last "
            "batch), or mark varying dimensions dynamic with torch._dynamo.mark_dynamic."
        ) from error
    peers = {r: json.loads(store.get(prefix + str(r))) for r in ranks}
    differing = sorted(r for r, info in peers.items() if info["digest"] != digest)
    if differing:
        other = peers[differing[0]]
        raise CollectiveMismatchError(
            f"zero3: the ranks compiled different collectives for graph #{sequence} ({label}); "
            f"they would hang or mix buffers. {_first_difference(me, signature, differing[0], other['signature'])} "
            "Every rank must run the same model code on inputs of the same shapes and dtypes "
            "(no rank-dependent branches in forward)."
        )
    log.debug(
        "[rank %d] zero3: graph #%d (%s): %d collectives agree on all ranks",
        me,
        sequence,
        label,
        len(signature),
    )


def _has_key(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _first_difference(rank_a: int, sig_a: list, rank_b: int, sig_b: list) -> str:
    sig_b = [tuple(entry) for entry in sig_b]
    for i, (a, b) in enumerate(zip(sig_a, sig_b)):
        if tuple(a) != b:
            return f"Collective {i}: rank {rank_a} issues {tuple(a)}, rank {rank_b} issues {b}."
    return f"Rank {rank_a} issues {len(sig_a)} collectives, rank {rank_b} issues {len(sig_b)}."


_CALL = re.compile(
    r"^\s*(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\("
)
_SIZE = re.compile(r"^\s*assert_size_stride\((\w+), \(([\d, ]*)\)")


def generated_collective_order(source_code: str) -> list[tuple[str, int | None]]:
    """(kind, output elements or None) of each collective in Inductor's generated wrapper code.

    The output size comes from Inductor's ``assert_size_stride`` line (None when size asserts are
    off). Kinds use the names of ``collective_signature``.
    """
    order: list[tuple[str, int | None]] = []
    pending: dict[str, int] = {}
    for line in source_code.splitlines():
        call = _CALL.match(line)
        if call:
            kind = "all_gather" if call.group(2) == "all_gather_into_tensor" else "reduce_scatter"
            pending[call.group(1)] = len(order)
            order.append((kind, None))
            continue
        size = _SIZE.match(line)
        if size and size.group(1) in pending:
            index = pending.pop(size.group(1))
            numel = math.prod(int(d) for d in size.group(2).replace(" ", "").split(",") if d)
            order[index] = (order[index][0], numel)
    return order


def expected_collective_order(graph: fx.Graph) -> list[tuple[str, int]]:
    """What ``generated_collective_order`` must find for ``graph``: kinds and output sizes."""
    kinds = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter"}
    return [
        (kinds[node.target], int(node.meta["val"].numel()))
        for node in graph.nodes
        if node.op == "call_function" and node.target in kinds
    ]


def check_generated_order(graph: fx.Graph, source_code: str | None, label: str) -> None:
    """Raise if Inductor's generated code issues the collectives in another order than ``graph``.

    All ranks run the same passes, but Inductor sees rank-specific shapes (uneven shards), so a
    reordering there could differ between ranks and hang them; this turns that into an error.
    """
    expected = expected_collective_order(graph)
    if not expected or source_code is None:
        return
    found = generated_collective_order(source_code)
    if not found:
        log.warning("zero3: could not read the collective order of %s from Inductor's code", label)
        return
    same = len(found) == len(expected) and all(
        fk == ek and (fn is None or fn == en) for (fk, fn), (ek, en) in zip(found, expected)
    )
    if not same:
        raise CollectiveMismatchError(
            f"zero3: Inductor reordered the collectives of {label}: scheduled {expected}, "
            f"generated {found}. This could hang ranks; use options={{'codegen': 'eager'}} "
            "and please report it."
        )
