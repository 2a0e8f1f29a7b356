"""Inductor internals: compile entry points, config patches, cache keys, the generated wrapper."""

from __future__ import annotations

import functools
import math
import pickle
import re
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh


def inductor_compile_fx():
    """``compile_fx`` / ``compile_fx_inner``: private, the only way to run Inductor on graphs we
    scheduled ourselves (2.11-2.14)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def partitioner_base() -> type:
    """Base class of a partition function Inductor's ``custom_partitioner_fn`` accepts (private,
    ``torch._inductor.custom_graph_pass``, 2.11-2.14)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def inductor_config_patches(mode: str | None) -> dict[str, Any]:
    """Inductor settings the scheduled graphs need (private ``torch._inductor.config`` keys).

    - ``reorder_for_peak_memory`` off: it would move every all-gather down to its wait.
    - ``reorder_for_locality`` off: a post-grad pass over inference graphs (and training graphs
      where 2.14's ``reorder_for_locality_in_training`` is set) that moves each node to just
      before its first user, so a wait moves down past the next collective's issue: two in flight
      where gloo's schedule keeps one.
    - ``aten_distributed_optimizations.enable_simple_overlap`` off where the key exists (on by
      default in 2.14, being reverted upstream over hangs): it moves collective starts and waits
      after our scheduler placed them.
    """
    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(torch._inductor.list_mode_options(mode))
    patches["reorder_for_peak_memory"] = False
    patches["reorder_for_locality"] = False
    if _config_has(inductor_config, "aten_distributed_optimizations.enable_simple_overlap"):
        patches["aten_distributed_optimizations.enable_simple_overlap"] = False
    return patches


def _config_has(config_module, key: str) -> bool:
    try:
        return key in config_module.get_config_copy()
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------------------- cache keys


def stable_mesh_cache_keys() -> None:
    """From now on, in this process, Inductor's and AOTAutograd's cache keys take a
    ``DeviceMesh`` (a graph input where DTensor parameters lift theirs, torch 2.13+; inside a
    backward graph's metadata) as its ranks, this rank's coordinate, device type, dimension names
    and groups. Torch pickles the mesh's whole state into the key, including a hash it computes
    lazily from strings (randomised per process), so such a graph never hit the cache in another
    process: a warm restart compiled it again (as did every graph ``record_graphs`` keeps from
    AOTAutograd's cache). Process-wide, not scoped to our compile: AOTAutograd compiles a backward
    graph at its first call. Only the key's bytes change, not what is compiled. Private
    (``FxGraphCachePickler``'s per-instance ``dispatch_table``, 2.11-2.14); a no-op where
    absent."""
    try:
        from torch._inductor.codecache import FxGraphCachePickler
    except ImportError:
        return
    original = FxGraphCachePickler.__init__
    if getattr(original, "_zero3_stable_meshes", False):
        return

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        table = getattr(self, "dispatch_table", None)
        if isinstance(table, dict):
            table[DeviceMesh] = _mesh_cache_key

    init._zero3_stable_meshes = True
    FxGraphCachePickler.__init__ = init


def _mesh_cache_key(mesh: DeviceMesh) -> tuple:
    """A mesh's reduction for a cache key: what identifies its collectives, nothing per process.
    A mesh that cannot say (its groups gone) keeps torch's own reduction: a per-process key,
    never a failed compile."""
    try:
        groups = tuple(group.group_name for group in mesh.get_all_groups())
        coordinate = mesh.get_coordinate()
    except (RuntimeError, AttributeError, ValueError, KeyError):
        return mesh.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    key = (mesh.device_type, mesh.mesh.tolist(), coordinate, mesh.mesh_dim_names, groups)
    return _only_a_cache_key, key


def _only_a_cache_key(*key):
    raise RuntimeError(f"{key} is a DeviceMesh's cache key, not a mesh")


# ------------------------------------------------------------------------------- wrapper code
# The shape of Inductor's generated Python wrapper (2.11-2.14): a ``def call(args)`` whose
# statements call extern kernels as ``bufN = torch.ops.<namespace>.<op>.default(...)``, wait with
# ``torch.ops._c10d_functional.wait_tensor.default(bufN)``, rename outputs as ``bufM = bufN`` and
# check sizes with ``assert_size_stride(bufN, (sizes...), ...)`` (2.14: ``assert_tensor_metadata``).
# Inductor re-inplaces all_reduce: a statement on the buffer it reduces, waited by that name.

_CALL = re.compile(
    r"^\s*(\w+) = torch\.ops\._c10d_functional\."
    r"(all_gather_into_tensor|reduce_scatter_tensor|all_reduce|all_to_all_single)\.default\("
)
# the cross-graph prefetch's take (a graph's first all-gather) and handoff (the next graph's)
_OURS = re.compile(r"^\s*(\w+) = torch\.ops\.zero3\.(take_gather|handoff_gather)\.default\(")
_IN_PLACE = re.compile(r"^\s*torch\.ops\._c10d_functional\.all_reduce_\.default\((\w+)")
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "take_gather": "all_gather",
    "handoff_gather": "handoff",
}
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)")
_ALIAS = re.compile(r"^\s*(\w+) = (\w+)\s*$")  # an extern kernel's output renamed: buf2 = buf1
# the size check: assert_size_stride(buf, (sizes), (strides)) through 2.13,
# assert_tensor_metadata(buf, (sizes), (strides), dtype, ...) in 2.14
_SIZE = re.compile(r"^\s*assert_(?:size_stride|tensor_metadata)\((\w+), \(([\d, ]*)\)")
_GUARD = re.compile(r"torch\.ops\.zero3\.guard\.default\(")


def generated_events(source_code: str) -> list[tuple[str, int]]:
    """The collective events of Inductor's generated wrapper code, in order: ("issue", k) and
    ("wait", k) for the k-th collective issued, and ("guard", -1)."""
    body = source_code.split("def call(", 1)[-1]
    events: list[tuple[str, int]] = []
    buffers: dict[str, int] = {}
    issued = 0
    for line in body.splitlines():
        call = _CALL.match(line) or _OURS.match(line) or _IN_PLACE.match(line)
        if call:
            buffers[call.group(1)] = issued
            events.append(("issue", issued))
            issued += 1
            continue
        alias = _ALIAS.match(line)
        if alias and alias.group(2) in buffers:
            buffers[alias.group(1)] = buffers[alias.group(2)]
            continue
        wait = _WAIT.search(line)
        if wait and wait.group(1) in buffers:
            events.append(("wait", buffers[wait.group(1)]))
            continue
        if _GUARD.search(line):
            events.append(("guard", -1))
    return events


def generated_collective_order(source_code: str) -> list[tuple[str, int | None]]:
    """(kind, output elements or None) of each collective in Inductor's generated wrapper code.

    The output size comes from Inductor's ``assert_size_stride`` line (2.14:
    ``assert_tensor_metadata``; None when size asserts are off). Kinds use the names of
    ``compiler.signature.collective_signature``.
    """
    order: list[tuple[str, int | None]] = []
    pending: dict[str, int] = {}
    for line in source_code.splitlines():
        call = _CALL.match(line) or _OURS.match(line)
        if call:
            kind = _KINDS[call.group(2)]
            pending[call.group(1)] = len(order)
            order.append((kind, None))
            continue
        if _IN_PLACE.match(line):
            order.append(("all_reduce", None))
            continue
        size = _SIZE.match(line)
        if size and size.group(1) in pending:
            index = pending.pop(size.group(1))
            numel = math.prod(int(d) for d in size.group(2).replace(" ", "").split(",") if d)
            order[index] = (order[index][0], numel)
    return order
