"""Higher-order ops (``torch._higher_order_ops``): checkpoint regions, ``wrap``, nested regions."""

from __future__ import annotations

import contextlib
import importlib

import torch


def checkpoint_hops() -> tuple:
    """Higher-order ops whose body is ``args[0]`` (a get_attr) called with ``args[1:]``:
    ``torch.utils.checkpoint`` regions and ``wrap``. Private (``torch._higher_order_ops``);
    checked 2.11-2.14."""
    ops = []
    higher_order = torch.ops.higher_order
    for name in ("tag_activation_checkpoint", "wrap"):
        op = getattr(higher_order, name, None)
        if op is not None:
            ops.append(op)
    return tuple(ops)


def invoke_subgraph_op():
    """``torch.ops.higher_order.invoke_subgraph`` (the op of ``nested_compile_region``), or
    None. Private (``torch._higher_order_ops``); checked 2.13-2.14."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def region_schemas_cached():
    """A context in which ``invoke_subgraph``'s schema is computed once per body and operand
    layout, not at every call.

    Torch's autograd key of a higher-order op asks for its schema at every call, to refuse input
    mutation in training; for ``invoke_subgraph`` that traces the region's body again
    (``materialize_as_graph``): three traces per block call during AOTAutograd, the largest cost
    that still grows with depth when every block calls one compiled body (18 s of 49 at 80
    blocks here). The schema is a function of the body and the operands' types and layouts, so
    within one compile it is looked up. Private (``torch._higher_order_ops.invoke_subgraph``);
    checked 2.13-2.14; where the class or method is missing nothing is cached.
    """
    try:
        module = importlib.import_module("torch._higher_order_ops.invoke_subgraph")
        hop_class = module.InvokeSubgraphHOP
        original = hop_class.__dict__["gen_schema"]
    except (ImportError, AttributeError, KeyError):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def cached():
        memo: dict = {}

        def gen_schema(self, subgraph, identifier, *operands):
            key = (id(subgraph), identifier, tuple(_layout(o) for o in operands))
            try:
                hit = memo.get(key)
            except TypeError:  # symbolic sizes: not hashable, not cached
                return original(self, subgraph, identifier, *operands)
            if hit is None:
                hit = memo[key] = (subgraph, original(self, subgraph, identifier, *operands))
            return hit[1]

        hop_class.gen_schema = gen_schema
        try:
            yield
        finally:
            hop_class.gen_schema = original

    return cached()


def _layout(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (
            type(value),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.device,
            value.requires_grad,
        )
    return (type(value), repr(value))
