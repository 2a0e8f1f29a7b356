"""What runs around a compiled graph: the cross-rank guard, and ``grad is None`` where eager
would leave it so.

AOTAutograd's backward receives zeros for forward outputs the loss did not use (autograd
materialises missing gradients), so every parameter input gets a gradient, zeros where eager
training leaves ``grad is None``; optimizers with momentum or weight decay would then move
parameters eager training does not touch. The dynamo graph tells which user outputs each
parameter's value flows into (``graph_facts.output_dependencies``); at run time a
pre-hook on AOTAutograd's backward node sees which outputs really received a gradient, the
backward guard makes that the union over ranks, and a parameter whose outputs all went unused on
every rank gets no gradient (``_Gate``). Gradients still flow through the same collectives on
every rank, so the ranks stay in step.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._torch.aot_autograd import compiled_function_offset, is_compiled_function_node
from ..sharding.state import ShardState, kept_state_of, state_of
from . import guard
from .write_through import GatheredParameter

log = logging.getLogger(__name__)

# The CallState whose compiled backward is running on this thread: set by the pre-hook of
# AOTAutograd's backward node, read by the guard at the top of that backward graph, cleared by the
# node's post-hook (a backward graph without collectives has no guard). Autograd runs a node's
# pre-hooks, the node and its post-hooks back to back on one thread, so no key is needed: keys
# baked into the graph (a backend-call counter) went stale when the compiled code was loaded
# from the cache by another process.
_pending = threading.local()


class CallState:
    """One forward call of a compiled graph with gated parameters, until its backward."""

    def __init__(self, num_outputs: int, dependencies: list[frozenset[int]]):
        self.num_outputs = num_outputs
        self.dependencies = dependencies
        self.presence: list[bool] | None = None
        self.absent: list[bool] | None = None

    def on_backward(self, offset: int | None, grad_outputs) -> None:
        """Pre-hook of AOTAutograd's backward node: which user outputs received a gradient."""
        if offset is None or offset + self.num_outputs > len(grad_outputs):
            self.presence = None
        else:
            self.presence = [
                g is not None for g in grad_outputs[offset : offset + self.num_outputs]
            ]
        _pending.call = self

    def after_backward(self, grad_inputs, grad_outputs) -> None:
        """Post-hook of the same node: its backward is over."""
        if getattr(_pending, "call", None) is self:
            _pending.call = None

    def decide(self, union: list[bool] | None) -> None:
        if union is None:
            self.absent = [False] * len(self.dependencies)
            return
        self.absent = [not any(union[j] for j in deps) for deps in self.dependencies]

    def is_absent(self, k: int) -> bool:
        if self.absent is None:  # no guard ran (a single rank): this rank's presence decides
            self.decide(self.presence)
        return self.absent[k]


def run_graph_guard(
    group: str, replicate_group: str, kind: int, code: int, label: str, timeout_s: float
) -> None:
    """The body of ``zero3::guard``: the cross-rank check on the side channel of the mesh the
    graph's collectives run on, with the backward's presence bits."""
    call = None
    if kind == guard.KIND_BACKWARD:
        call = getattr(_pending, "call", None)
        _pending.call = None
    presence = call.presence if call is not None else None
    union = guard.run_check(
        guard.channel_of(group, replicate_group), kind, code, label, presence, timeout_s
    )
    if call is not None:
        call.decide(union if presence is not None else None)


class _Gate(torch.autograd.Function):
    """Identity on a parameter; its backward drops the gradient when no rank produced one."""

    @staticmethod
    def forward(ctx, param, call: CallState, k: int):
        ctx.call, ctx.k = call, k
        # a parameter the graph computes no gradient for (read under no_grad only) must stay
        # without one: materialised, its missing gradient would arrive as plain zeros
        ctx.set_materialize_grads(False)
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        if grad is None or ctx.call.is_absent(ctx.k):
            return None, None, None
        return grad, None, None


class GatedCall:
    """The callable handed back to dynamo: AOTAutograd's compiled function, with the parameters
    whose gradient may be structurally absent passed through ``_Gate``, and the computed inputs
    that get no gradient passed detached."""

    def __init__(self, compiled: Callable, compile_ctx, num_outputs: int):
        self.compiled = compiled
        self.compile_ctx = compile_ctx
        self.num_outputs = num_outputs
        self._gated: list[tuple[int, frozenset[int]]] | None = None

    def _plan(self, args) -> list[tuple[int, frozenset[int]]]:
        """The inputs whose gradient may be structurally absent: sharded parameters, or while
        gradient sync is off (this graph is then compiled for that state) their sinks, which
        receive the gradient instead, or the full parameters kept gathered (``keep_gathered``),
        whose .grad accumulates it (their graphs may run no guard: each rank then decides alone,
        and turning sync back on agrees over the ranks). A parameter in those states is never gated
        itself: its shard gets no gradient from the graph, and AOTAutograd hands a gated shard
        input its sink's gradient (a full-size plain tensor in the parameter's .grad)."""
        deps = self.compile_ctx.gradient_dependencies
        with_tangents = frozenset(j for d in deps.values() if d is not None for j in d)
        if len({id(a) for a in args}) != len(args):  # duplicated inputs: indices are ambiguous
            return []
        sinks = {}
        for arg in args:
            state = state_of(arg)
            if state is not None and state.grad_sink is not None:
                sinks[id(state.grad_sink)] = state
        gated = []
        for index, outputs in sorted(deps.items()):
            if outputs is None or index >= len(args) or outputs == with_tangents:
                continue
            arg = args[index]
            if not getattr(arg, "requires_grad", False):
                continue
            state = state_of(arg)
            if state is not None and state.state is ShardState.SHARDED:
                gated.append((index, outputs))
            elif state is None and (id(arg) in sinks or kept_state_of(arg) is not None):
                gated.append((index, outputs))
        return gated

    def __call__(self, *args):
        if any(type(a) is GatheredParameter for a in args):
            # full parameters eager code gathered (a graph break before this graph): plain inputs
            args = tuple(
                a.as_subclass(torch.Tensor) if type(a) is GatheredParameter else a for a in args
            )
        if self._gated is None:
            self._gated = self._plan(args)
            if self._gated:
                log.debug(
                    "zero3: graph %d: %d parameter(s) may end without a gradient",
                    self.compile_ctx.index,
                    len(self._gated),
                )
        detach = self.compile_ctx.detachable_inputs
        if detach and torch.is_grad_enabled():
            # no gradient reaches them: backward must not run the graph that produced them
            # (graph_facts.detachable_inputs)
            args = tuple(
                a.detach()
                if i in detach and isinstance(a, torch.Tensor) and a.grad_fn is not None
                else a
                for i, a in enumerate(args)
            )
        if not self._gated or not torch.is_grad_enabled():
            return self.compiled(*args)
        call = CallState(self.num_outputs, [deps for _, deps in self._gated])
        args = list(args)
        for k, (index, _) in enumerate(self._gated):
            args[index] = _Gate.apply(args[index], call, k)
        outputs = self.compiled(*args)
        node = _compiled_function_node(outputs)
        if node is None:
            call.decide(None)  # cannot tell: every gradient counts as present
        else:
            node.register_prehook(
                functools.partial(call.on_backward, compiled_function_offset(node))
            )
            node.register_hook(call.after_backward)
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def _compiled_function_node(outputs) -> Any:
    tensors = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    frontier = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(4):
        next_frontier = []
        for node in frontier:
            if is_compiled_function_node(node):
                return node
            next_frontier.extend(fn for fn, _ in node.next_functions if fn is not None)
        frontier = next_frontier
    return None
