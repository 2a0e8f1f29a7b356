"""AOTAutograd / functorch internals: the partitioner, saved values, runtime metadata."""

from __future__ import annotations

import torch


def min_cut_partition(gm, joint_inputs, **kwargs):
    """The default partitioner. Private (``torch._functorch.partitioners``), no public alternative
    for a custom partition step; the signature is stable 2.11-2.14."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def order_saved_values(fw_module, bw_module, num_fwd_outputs: int) -> None:
    """Put the forward's saved values in the order AOTAutograd slices them: tensors checked for
    version changes, tensors not checked, opaque objects, symbolic ints; the backward's
    placeholders likewise (symbolic ints first).

    Works around the 2.13 partitioner emitting a ``DeviceMesh`` (opaque: every ``DTensor``
    parameter's gradient needs it) before tensors that an activation-checkpointed
    ``scaled_dot_product_attention`` saves, which AOTAutograd then rejects ("expected all
    tensors_saved_with_vc_check to be Tensors"). A no-op on graphs already in order.
    """
    output = next(n for n in reversed(fw_module.graph.nodes) if n.op == "output")
    outputs = list(output.args[0])
    saved = outputs[num_fwd_outputs:]
    group = saved_value_group

    # the backward takes the symbolic ints first, then the other saved values in forward order
    syms = [n for n in saved if group(n) == 3]
    rest = [n for n in saved if group(n) != 3]
    order = sorted(range(len(rest)), key=lambda i: group(rest[i]))  # stable
    if order == list(range(len(rest))):
        return
    output.args = (outputs[:num_fwd_outputs] + [rest[i] for i in order] + syms, *output.args[1:])
    fw_module.recompile()
    placeholders = [n for n in bw_module.graph.nodes if n.op == "placeholder"]
    taken = placeholders[len(syms) : len(syms) + len(rest)]
    after = taken[-1].next
    for i in order:  # the backward's saved-value inputs in the new order, where they were
        after.prepend(taken[i])
    bw_module.graph.lint()
    bw_module.recompile()


def saved_value_group(node) -> int:
    """Where AOTAutograd slices a saved value: 0 a tensor checked for version changes, 1 one not
    checked, 2 an opaque object, 3 a symbolic int (``order_saved_values``)."""
    from torch._functorch.partitioners import is_sym_node

    if is_sym_node(node):
        return 3
    if is_opaque_node(node):
        return 2
    return 1 if node.meta.get("saved_tensor_with_no_vc_check", False) else 0


def is_opaque_node(node) -> bool:
    """A saved value AOTAutograd slices as an opaque object (a ``DeviceMesh``, a process group).
    Private ``graph_compile.is_opaque_node`` from 2.13; 2.11 counts fake script objects only."""
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node as torch_is_opaque
    except ImportError:  # torch 2.11, 2.12
        from torch._library.fake_class_registry import FakeScriptObject

        val = getattr(node, "meta", {}).get("val")
        return isinstance(val, (torch.ScriptObject, FakeScriptObject))
    return torch_is_opaque(node)


def autograd_cache_disabled():
    """AOTAutograd's cache off for a ``with`` block (private ``torch._functorch.config``,
    2.11-2.14)."""
    from torch._functorch import config as functorch_config

    return functorch_config.patch(enable_autograd_cache=False)


def compiled_function_offset(node) -> int | None:
    """Where the user outputs start among the outputs of AOTAutograd's autograd.Function (after
    the inputs it mutates at runtime). Private metadata (``ViewAndMutationMeta``), 2.11-2.14."""
    forward_cls = getattr(type(node), "_forward_cls", None)
    metadata = getattr(forward_cls, "metadata", None)
    count = getattr(metadata, "num_mutated_inp_runtime_indices", None)
    return count if isinstance(count, int) else None


def is_compiled_function_node(node) -> bool:
    """Whether an autograd graph node is the backward of AOTAutograd's autograd.Function (its
    private class name ``CompiledFunctionBackward``), 2.11-2.14."""
    return type(node).__name__ == "CompiledFunctionBackward"


def mark_boxed(fn):
    """Mark ``fn(args)`` as taking its inputs as one list it may clear (the boxed calling
    convention): AOTAutograd and Inductor read the private ``_boxed_call`` attribute that torch's
    ``make_boxed_func`` sets (which wraps ``fn`` instead of marking it); checked 2.13-2.14."""
    fn._boxed_call = True
    return fn
