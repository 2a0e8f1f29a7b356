"""The root unit of per-block compile: the parameters outside the compiled blocks, gathered
together when the model is called.

With ``for block in model.layers: block.compile(backend="zero3")`` (FSDP2's and torchtitan's
habit) the model's own forward runs eagerly, and each parameter it reads outside the blocks (the
embeddings, the final norm, the head) would be gathered on its own, with its own cross-rank
check, and reduced on its own in backward: on a 2-rank loopback each is a rendezvous of about
2 ms. So, as FSDP2 gathers its root module's parameters in one all-gather, the model's eager
forward gathers all of them in one collective per scheme (``UnshardMany``: one check, one
all-gather; in backward, one check and one reduce-scatter once their gradients are in), and its
reads of them take the gathered tensors (the ``scope`` of a leaf module, ``leaves.py``).

Members: the parameters of modules that no compiled module contains (``Module.compile()``,
or a ``torch.compile`` wrapper put in the parent's place); nothing when no submodule is compiled
(an eager model gathers each parameter when read, which keeps one block's parameters gathered at
a time). Like FSDP2's root, they stay gathered for the model's whole forward; uncompiled blocks
are members too, as FSDP2 puts modules outside its sub-units into the root unit. While gradient
sync is off, or a member is not plainly sharded (kept gathered, loading), the reads gather one by
one as before. A whole-model compile traces the hooks and does nothing here: the graph passes
bucket its gathers.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .._torch.modules import own_children
from ..sharding.state import ShardState, module_state
from .leaves import close_scope, gather_members, open_scope


def install_root_unit(root: nn.Module) -> None:
    """Gather the parameters outside the compiled blocks together when ``root`` is called."""
    root.register_forward_pre_hook(_Enter())
    root.register_forward_hook(_Exit(), always_call=True)


def unit_members(root: nn.Module) -> list[tuple]:
    """(module state, attribute, owner) of every parameter of ``root`` outside its compiled
    submodules; empty when none of its submodules is compiled."""
    members: list[tuple] = []
    compiled = False
    stack = [root]
    while stack:
        module = stack.pop()
        state = module_state(module)
        if state is not None:
            members.extend((state, attr, module) for attr in state.params)
        for child in own_children(module).values():
            if child is None:
                continue
            if _is_compiled(child):
                compiled = True
                continue
            stack.append(child)
    return members if compiled else []


def _is_compiled(module: nn.Module) -> bool:
    from .._torch.dynamo import is_compiled_module

    return is_compiled_module(module)


class _Enter:
    """A forward pre-hook (a class, so that a model with it pickles)."""

    def __call__(self, module, args):
        if torch.compiler.is_compiling():
            return
        members = unit_members(module)
        if not members:
            return
        if any(state.scope is not None for state, _, _ in members):
            return  # called inside another call of the model: gathered already
        params = [state.params[attr] for state, attr, _ in members]
        if not all(p.state is ShardState.SHARDED and p.requires_sync for p in params):
            return
        open_scope(members, gather_members(members))
        module.__dict__["_zero3_unit"] = members


class _Exit:
    def __call__(self, module, args, output):
        if torch.compiler.is_compiling():
            return  # nothing was gathered (_Enter); torch 2.11's dynamo breaks the graph at pop
        close_scope(module.__dict__.pop("_zero3_unit", ()))
