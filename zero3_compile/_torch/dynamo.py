"""Dynamo internals: backend registration, compile counters, rewrites of dynamo's graphs."""

from __future__ import annotations

import torch
import torch.nn as nn

from . import VERSION, dtensor


def register_dynamo_backend(fn, name: str) -> None:
    """Register a backend unless the entry point (or an import) did already."""
    from torch._dynamo.backends import registry

    # private tables: the public ``register_backend`` raises on a second registration
    if name in registry._COMPILER_FNS or registry._BACKENDS.get(name) is not None:
        return
    registry.register_backend(fn, name=name)


def aot_autograd_backend(**kwargs):
    """``torch._dynamo.backends.common.aot_autograd``: semi-public (documented for custom
    backends), 2.11-2.14."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


def dynamo_compile_count() -> tuple[int, int, int] | None:
    """(frame id, how many times dynamo has compiled that frame so far, its recompile limit)
    for the compile in progress; None outside one. ``CompileContext`` is private; its
    ``frame_compile_id`` counts from 0. The limit was ``cache_size_limit`` before torch 2.6."""
    import torch._dynamo
    import torch._guards

    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_compile_id is None:
        return None
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8)
    return compile_id.frame_id, compile_id.frame_compile_id + 1, int(limit)


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(module)``'s wrapper (private ``OptimizedModule``
    class) or was compiled in place by ``module.compile()`` (which sets the private
    ``_compiled_call_impl``); 2.11-2.14."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def uncompiled(model):
    """The module ``torch.compile(module)`` wraps (``OptimizedModule``'s private ``_orig_mod``),
    else ``model`` itself; checked 2.13-2.14."""
    return getattr(model, "_orig_mod", model)


def compiled_function_original(fn):
    """The callable a ``torch.compile``'d function wraps (the private
    ``_torchdynamo_orig_callable`` dynamo sets on its wrappers), else None; checked 2.13-2.14."""
    return getattr(fn, "_torchdynamo_orig_callable", None)


def inner_backend(callback):
    """The next backend or callable inside a dynamo backend wrapper (the private
    ``_torchdynamo_orig_backend`` / ``_torchdynamo_orig_callable`` it keeps), else None;
    checked 2.13-2.14."""
    return getattr(callback, "_torchdynamo_orig_backend", None) or getattr(
        callback, "_torchdynamo_orig_callable", None
    )


def nested_regions_take_dtensor_inputs() -> bool:
    """Whether dynamo traces a nested compile region (``invoke_subgraph``) whose body reads
    sharded (DTensor) parameters. torch 2.11 and 2.12 do not: their subgraph speculation asserts
    that every lifted input is a FakeTensor ("Expected FakeTensor, got DTensor"); 2.13 and 2.14
    do (all four checked)."""
    return VERSION >= (2, 13)


def set_grad_enabled_target():
    """What dynamo records for ``torch.no_grad()`` / ``enable_grad()`` regions (the private
    ``torch._C._set_grad_enabled``), 2.11-2.14."""
    return torch._C._set_grad_enabled


def is_dtensor_to_local(node) -> bool:
    """Whether an FX node of a dynamo graph is ``DTensor.to_local()``: a ``to_local`` method call,
    or on torch 2.11 a call of a fresh closure dynamo names "prim_to_local" (no public way to
    recognise it; gone in 2.13)."""
    if node.op == "call_method":
        return node.target == "to_local"
    return node.op == "call_function" and getattr(node.target, "__name__", None) == "prim_to_local"


def normalize_to_local(gm) -> bool:
    """Rewrite torch 2.11's ``prim_to_local`` closure calls (made without arguments) as
    ``to_local`` method calls, in ``gm`` and its subgraphs; returns whether anything changed.

    AOTAutograd's cache bypasses any graph holding a call of an unknown function, so on 2.11
    nothing of ours was ever cached. The closure's captured arguments are read to make sure
    there are none (private dynamo detail of 2.11/2.12; 2.13 records a method call itself).
    """

    def as_method(graph, node):
        if not (is_dtensor_to_local(node) and node.op == "call_function"):
            return None
        captured = [c.cell_contents for c in node.target.__closure__ or ()]
        if any(captured) or len(node.args) != 1 or node.kwargs:
            return None  # to_local(grad_placements=...): leave it (not cached)
        return graph.call_method("to_local", node.args)

    return _replace_nodes(gm, as_method)


def rewrite_to_local(gm, cache_key: str) -> bool:
    """On torch 2.11, replace ``x.to_local()`` calls of a dynamo graph (and its subgraphs) by
    ``dtensor.local_shard(x)``; returns whether anything changed. ``cache_key`` keeps
    AOTAutograd's cache open to the call (its ``fx.wrap`` convention: ``is_wrapped`` with
    ``user_cache_hash``; an unknown function otherwise bypasses the cache)."""
    if dtensor.to_local_keeps_missing_gradients():
        return False

    def swap(graph, node):
        if not (node.op == "call_method" and node.target == "to_local"):
            return None
        if len(node.args) != 1 or node.kwargs:
            return None  # to_local(grad_placements=...): torch's own
        call = graph.call_function(dtensor.local_shard, node.args)
        call.meta.update(is_wrapped=True, user_cache_hash=cache_key)
        return call

    return _replace_nodes(gm, swap)


def _replace_nodes(gm, replacement) -> bool:
    """In ``gm`` and its subgraphs, put ``replacement(graph, node)`` (a node it inserts, or None
    to keep ``node``) in each node's place, with the node's meta; returns whether any changed."""
    changed = False
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        touched = False
        for node in list(graph.nodes):
            with graph.inserting_before(node):
                new = replacement(graph, node)
            if new is None:
                continue
            new.meta = {**node.meta, **new.meta}
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            touched = True
        if touched:
            graph.lint()
            module.recompile()
            changed = True
    return changed
