"""Hooks on the optimizers of a sharded model, and only on those.

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
"""

from __future__ import annotations

from ..offload.params import load_shards, store_shards
from ..sharding.state import ShardState, state_of

_installed: list = []


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
