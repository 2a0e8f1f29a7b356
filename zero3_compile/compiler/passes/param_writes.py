"""Refuse in-place writes to gathered parameters inside a compiled graph."""

from __future__ import annotations

import operator

import torch.fx as fx

from ...collectives.ops import is_unshard
from ..context import PassContext
from ..markers import UnshardCall

# dynamo records tensor methods by name; these return a view of the tensor they are called on
_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "expand",
    "expand_as", "narrow", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "detach",
    "as_strided", "chunk", "split", "unbind", "__getitem__", "contiguous",
}  # fmt: skip


def refuse_param_writes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Raise if the dynamo graph writes in place to a gathered parameter or a view of one.

    **Invariant** checked: no ``x.mul_()``, ``x.copy_()``, ``x[i] = v``... on the result of an
    ``unshard`` marker. Such a write changes a temporary copy, not the shards, so it would be
    silently lost; eager code (outside ``torch.compile``) writes through to the shards instead.
    """
    for marker in gm.graph.nodes:
        if not is_unshard(marker):
            continue
        for node in _aliases(marker):
            for user in node.users:
                if _writes_first_argument(user) and user.args and user.args[0] is node:
                    name = UnshardCall.of(marker).spec.fqn
                    where = user.meta.get("stack_trace", "").strip().splitlines()
                    raise RuntimeError(
                        f"zero3: the compiled code writes in place to parameter {name!r} "
                        f"({_describe(user)}{' at ' + where[-2].strip() if len(where) > 1 else ''}). "
                        "Inside torch.compile that would change a gathered copy, not the shards, "
                        "and be lost. Do such writes outside the compiled region (under "
                        "torch.no_grad(), eager writes to module parameters reach the shards)."
                    )


def _aliases(marker: fx.Node) -> list[fx.Node]:
    found, stack = [marker], [marker]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "call_method" and user.target in _VIEW_METHODS and user.args[0] is node:
                found.append(user)
                stack.append(user)
            elif user.op == "call_function" and user.target is operator.getitem:
                if user.args[0] is node:
                    found.append(user)
                    stack.append(user)
    return found


def _writes_first_argument(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and not name.startswith("_")
    return False


def _describe(node: fx.Node) -> str:
    name = (
        node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
    )
    return f"{name}"
