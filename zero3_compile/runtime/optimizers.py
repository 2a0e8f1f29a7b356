"""Hooks on the optimizers of a sharded model, and only on those; optimizers over the parameters
as they were before ``shard()`` re-pointed to the sharded ones.

torch has no event for "an optimizer was built over these parameters", so one small discovery
hook (``register_optimizer_step_pre_hook``, installed once a model needs optimizer hooks) looks at
an optimizer's parameters the first time it steps (and again when its parameter groups change):
for each sharded model among them it registers that model's runtime's own step hooks on that
optimizer instance. Optimizers without sharded parameters are looked at once per change of their
parameter groups and never hooked.

What the runtime's hooks do, for the optimizer's parameters of their model:
- refuse a step while gradients accumulated with gradient sync off are still unreduced (it would
  apply a partial gradient: ``set_requires_gradient_sync``);
- load offloaded parameter shards for the step and store them after it (a plain optimizer over
  ``shard(offload=...)`` parameters; ``offload_optimizer`` streams them tile by tile itself).

[Note: optimizers built before shard]
``shard()`` cannot always make the user's ``nn.Parameter`` object the sharded parameter: torch
2.13's ``swap_tensors`` refuses to swap a plain ``Parameter`` with a ``DTensor`` one (different
layouts). The original then stays a full-size tensor outside the model, marked with its
replacement (``mark_replaced``), and an optimizer built before ``shard()`` would update it, not
the model: silently nothing. So such an optimizer is re-pointed: its parameter groups take the
sharded parameters, its state (if it stepped already) is cut to this rank's rows
(``repoint``). ``shard()`` finds the optimizers holding originals at once
(``repoint_optimizers_holding``: only when an original outlives the call, one scan of the
garbage collector's objects) so the full-size originals are freed; the discovery hook
re-points any other optimizer at its first step. One whose state cannot be cut (a state tensor
shaped unlike its parameter) raises at that step, naming the fix.

A parameter read as an attribute after ``shard()`` (``layer.weight``) is the gathered full tensor,
a non-leaf that ``Optimizer.add_param_group`` refuses; handed to an optimizer
(``SGD([layer.weight])``) it stands for its sharded parameter instead (``optimizer_param``,
asked by the gathered tensor when ``add_param_group`` reads its ``is_leaf``).
"""

from __future__ import annotations

import gc
import inspect
import sys
import weakref

import torch

from ..offload.params import load_shards, store_shards
from ..sharding.state import ShardState, state_of

_installed: list = []
_REPLACED_BY = "_zero3_replaced_by"
_hooked: weakref.WeakSet = weakref.WeakSet()  # optimizers holding sharded parameters


def watch_optimizers() -> None:
    """Install the discovery hook (once per process)."""
    if not _installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _installed.append(register_optimizer_step_pre_hook(_discover))


def _discover(optimizer, args, kwargs) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen = optimizer.__dict__.get("_zero3_runtimes")
    if seen is not None and seen[0] == len(params):
        return
    if any(_stands_for(p) is not None for p in params):
        repoint(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
    hooked = seen[1] if seen is not None else {}
    for param in params:
        state = state_of(param)
        runtime = None if state is None else state.root
        if runtime is None or id(runtime) in hooked:
            continue
        # registered while the global hooks run: step() iterates the instance hooks after them,
        # so they already run for this step
        pre = optimizer.register_step_pre_hook(runtime.before_step)
        post = optimizer.register_step_post_hook(runtime.after_step)
        hooked[id(runtime)] = (runtime, pre, post)
    if hooked:
        _hooked.add(optimizer)
    optimizer.__dict__["_zero3_runtimes"] = (len(params), hooked)


def _own_states(runtime, optimizer) -> list:
    found, seen = [], set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = state_of(param)
            if state is not None and state.root is runtime and id(state) not in seen:
                seen.add(id(state))
                found.append(state)
    return found


def before_step(runtime, optimizer) -> None:
    states = _own_states(runtime, optimizer)
    for state in states:
        _check_no_pending_gradients(state)
    if runtime.offload is None or getattr(optimizer, "_zero3_tiled", False):
        return
    offloaded = [s for s in states if s.offload is not None]
    loaded = optimizer.__dict__.setdefault("_zero3_loaded", {})
    loaded[id(runtime)] = offloaded
    load_shards(offloaded)


def after_step(runtime, optimizer) -> None:
    loaded = optimizer.__dict__.get("_zero3_loaded", {})
    states = loaded.pop(id(runtime), None)
    if states:
        store_shards(states)


def _check_no_pending_gradients(state) -> None:
    """Refuse a step while a sharded parameter holds unreduced gradients."""
    sink = state.grad_sink
    kept = state.kept_full is not None and state.kept_full.grad is not None
    if not (kept or (sink is not None and sink.grad is not None)):
        return
    fix = (
        "call z3.set_requires_gradient_sync(model, True) before the last micro-batch's "
        "backward (with keep_gathered=True: at the latest before the step)"
        if state.state is not ShardState.SHARDED
        else "run the last micro-batch's backward after turning sync back on: it reduces them "
        "(a pipeline schedule's step() runs every backward: use keep_gathered=True, whose "
        "gradients are reduced when sync is turned on, or zero3_compile.parallel.PipelineStage)"
    )
    raise RuntimeError(
        f"zero3: optimizer.step() while {state.fqn!r} holds gradients accumulated with "
        f"gradient sync off and not reduced yet, so the step would apply a partial "
        f"gradient: {fix}"
    )


# ------------------------------------------------------------------ optimizers built before shard


def mark_replaced(original: torch.Tensor, sharded: torch.Tensor) -> None:
    """``sharded`` replaces ``original`` in the model (see [Note: optimizers built before shard])."""
    original.__dict__[_REPLACED_BY] = sharded


def _stands_for(param) -> torch.Tensor | None:
    """The sharded parameter an optimizer should hold instead of ``param``; None if ``param`` is
    one already or no parameter of a sharded model."""
    replaced = getattr(param, "__dict__", {}).get(_REPLACED_BY)
    if replaced is not None:
        return replaced
    from .write_through import whole_parameter

    return whole_parameter(param)


def repoint(optimizer: torch.optim.Optimizer) -> None:
    """Put the sharded parameters in place of the originals (and whole gathered reads) in
    ``optimizer``'s groups; cut its state of them to this rank's rows. Checks everything before
    changing anything: raises (naming the fix) and leaves the optimizer as it was if a state
    cannot be cut."""
    moves = []  # (group's list, index, original, sharded, its new state or None)
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            sharded = _stands_for(param)
            if sharded is None:
                continue
            old_state = optimizer.state.get(param) if param in optimizer.state else None
            new_state = None if old_state is None else _cut_state(old_state, sharded)
            moves.append((group["params"], index, param, sharded, new_state))
    for params, index, original, sharded, new_state in moves:
        params[index] = sharded
        if new_state is not None:
            optimizer.state.pop(original, None)
            optimizer.state[sharded] = new_state


def _cut_state(old: dict, sharded: torch.Tensor) -> dict:
    """This rank's rows of the state tensors of the parameter ``sharded`` replaced."""
    state = state_of(sharded)
    spec = state.spec
    cut = {}
    for key, value in old.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            cut[key] = value  # Adam's step, hyperparameters
            continue
        if type(value) is not torch.Tensor or tuple(value.shape) != tuple(spec.shape):
            raise RuntimeError(
                f"zero3: an optimizer built before zero3_compile.shard(model) holds state "
                f"{key!r} of {state.fqn!r} shaped {tuple(value.shape)} (the parameter is "
                f"{tuple(spec.shape)}), which cannot be cut into the parameter's shards; build "
                "the optimizer after shard() from model.parameters() (load its state with "
                "z3.load_checkpoint)"
            )
        local = spec.chunk(value.detach(), state.rank).to(state.local().device)
        cut[key] = state.root.dp.wrap(local, spec, state.layout)
    return cut


def repoint_optimizers_holding(originals: list[weakref.ref]) -> None:
    """Re-point the optimizers holding any of ``originals`` (parameters ``shard()`` replaced)
    now, so that they are freed; an optimizer that cannot be is left to raise at its step."""
    if not any(ref() is not None for ref in originals):
        return  # nothing outlived the call: no optimizer holds one
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):
            continue
        params = [p for group in getattr(obj, "param_groups", ()) for p in group["params"]]
        if any(getattr(p, "__dict__", {}).get(_REPLACED_BY) is not None for p in params):
            obj.__dict__.pop("_zero3_runtimes", None)  # its next step looks at it again
            try:
                repoint(obj)
            except RuntimeError:
                pass  # raised again, to the user, at its first step (_discover)


def optimizer_param(param) -> bool:
    """Whether ``param`` (a whole gathered parameter) is being handed to an optimizer's
    ``add_param_group``; if so, the sharded parameter takes its place in the group it is read
    from. Called when ``add_param_group`` reads ``param.is_leaf`` (``write_through.py``)."""
    # torch internals (checked on 2.13): add_param_group (under dynamo's disable wrapper) reads
    # ``is_leaf`` of each tensor of its local ``param_group["params"]`` list; without that shape
    # the read answers as before (False) and torch raises its own error
    add_param_group = inspect.unwrap(torch.optim.Optimizer.add_param_group).__code__
    frame = sys._getframe(1)
    for _ in range(6):  # the property read goes through __torch_function__ and its helpers
        if frame is None:
            return False
        if frame.f_code is add_param_group:
            break
        frame = frame.f_back
    else:
        return False
    group = frame.f_locals.get("param_group")
    params = group.get("params") if isinstance(group, dict) else None
    if not isinstance(params, list):
        return False
    sharded = _stands_for(param)
    found = False
    for index, item in enumerate(params):
        if item is param:
            params[index] = sharded
            found = True
    return found


def optimizer_state(param: torch.Tensor) -> dict | None:
    """The optimizer state of ``param`` (a sharded parameter): from the optimizers that stepped
    over it, else (an optimizer that has not stepped: its state loaded) one scan of the garbage
    collector's objects; None where no optimizer holds state for it."""
    for optimizer in list(_hooked):
        if param in optimizer.state:
            return optimizer.state[param]
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer) and param in getattr(obj, "state", {}):
            _hooked.add(obj)
            return obj.state[param]
    return None
