"""Leaf modules: a block whose parameters are gathered together, once, when it is called."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.nn as nn

from .._torch.modules import own_children
from ..sharding.state import ShardedParam, module_state


def set_leaf_modules(model: nn.Module, modules: Iterable[type | nn.Module]) -> list[nn.Module]:
    """Gather the parameters of each given module (and of all its descendants) together, once,
    when it is called, on every rank, whichever of them its forward then reads.

    For blocks whose parameter reads depend on the data, a mixture-of-experts layer looping over
    the experts that received tokens: without it, each rank would gather the experts it uses and
    the ranks' collectives would differ. ``modules`` are classes (every instance in ``model``) or
    module instances. Modules with a child named ``experts`` are leaves already. Returns the leaf
    modules of ``model``.

    Their full parameters stay alive for the block's whole forward (and, eagerly, until its
    backward), as with DeepSpeed's leaf modules.

    Example:
        ```python
        z3.shard(model)
        z3.set_leaf_modules(model, [MoEBlock])  # every rank gathers all experts of a block at once
        ```
    """
    modules = check_leaf_modules(modules)
    wanted_types = tuple(m for m in modules if isinstance(m, type))
    wanted_ids = {id(m) for m in modules if isinstance(m, nn.Module)}
    leaves = []
    for sub in model.modules():
        if not (isinstance(sub, wanted_types) or id(sub) in wanted_ids):
            continue
        state = module_state(sub)
        if state is None:
            raise ValueError(
                f"zero3: set_leaf_modules needs a sharded model; call zero3_compile.shard(model) "
                f"first ({type(sub).__name__} is not sharded)"
            )
        leaves.append(sub)
        if any(ref() is sub for ref in state.root.leaves):
            continue
        state.root.leaves.append(weakref.ref(sub))
        members = [
            (module_state(owner), attr, owner)
            for owner in sub.modules()
            for attr in module_state(owner).params
        ]
        sub.register_forward_pre_hook(_leaf_enter(members))
        sub.register_forward_hook(_leaf_exit(members), always_call=True)
    return leaves


def check_leaf_modules(modules) -> list:
    """The entries of ``leaf_modules`` as a list; a clear error for anything but module classes
    and modules."""
    modules = list(modules or ())
    for item in modules:
        if not (
            isinstance(item, nn.Module) or (isinstance(item, type) and issubclass(item, nn.Module))
        ):
            raise TypeError(
                f"zero3: leaf_modules takes module classes or modules (e.g. [LlamaDecoderLayer]), "
                f"got {item!r}"
            )
    return modules


def detected_leaves(model: nn.Module) -> list[nn.Module]:
    """Mixture-of-experts blocks: modules with a child named ``experts`` (Mixtral, Qwen2-MoE,
    DeepSeek, OLMoE, Switch, and most hand-written ones)."""
    return [m for m in model.modules() if "experts" in own_children(m)]


def _leaf_enter(members):
    def enter(module, args):
        if any(state.scope is not None for state, _, _ in members):
            return  # inside an enclosing leaf: gathered already
        syncing = all(state.params[attr].requires_sync for state, attr, _ in members)
        if torch.compiler.is_compiling() or not syncing:
            # traced: the passes bucket the markers; sync off: each gradient goes to its sink
            fulls = [getattr(owner, attr) for _, attr, owner in members]
        else:
            fulls = gather_members(members)
        open_scope(members, fulls)

    return enter


def _leaf_exit(members):
    def exit_(module, args, output):
        close_scope(members)

    return exit_


def open_scope(members, fulls) -> None:
    """Reads of ``members`` ((module state, attribute, owner)) return ``fulls`` until
    ``close_scope`` (the generated getters look in their module state's ``scope`` first)."""
    for (state, attr, _), full in zip(members, fulls):
        if state.scope is None:
            state.scope = {}
        state.scope[attr] = full


def close_scope(members) -> None:
    for state, _, _ in members:
        state.scope = None


def gather_members(members) -> list[torch.Tensor]:
    """The full parameters of ``members`` ((module state, attribute, owner)), gathered together
    (``UnshardMany``: one collective per scheme; their gradients reduced together in backward)."""
    from ..collectives.ops import UnshardMany
    from ..runtime.write_through import gathered_parameter
    from ..sharding.layout import wrap_full

    unique: dict[int, ShardedParam] = {}
    for state, attr, _ in members:
        param_state = state.params[attr]
        unique.setdefault(id(param_state), param_state)
    params = list(unique.values())
    fulls = UnshardMany.apply(tuple(params), *[p.local() for p in params])
    by_state = {id(p): wrap_full(p, gathered_parameter(f, p)) for p, f in zip(params, fulls)}
    return [by_state[id(state.params[attr])] for state, attr, _ in members]
