"""Every torch API this package uses that is private or changed between releases, in one place.

Supported: torch 2.11 through 2.14 (``pyproject.toml`` pins ``<2.15`` until a newer release
passes the suite). Each entry says why we need it, the public alternative if there is one, and
the versions it was checked on. The graph-level functional collectives
(``torch.ops._c10d_functional``) are the stable layer: their Python wrappers were renamed in 2.13,
the ops were not.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

funcol = torch.ops._c10d_functional

ALL_GATHER = funcol.all_gather_into_tensor.default
REDUCE_SCATTER = funcol.reduce_scatter_tensor.default
ALL_REDUCE = funcol.all_reduce.default
# Inductor's re-inplacing turns all_reduce into all_reduce_ in the graphs it compiles
ALL_REDUCE_INPLACE = funcol.all_reduce_.default
WAIT = funcol.wait_tensor.default
# compressed gradient reductions (ZeRO++'s qgZ): each rank's quantized rows to their owner
ALL_TO_ALL = funcol.all_to_all_single.default
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_REDUCE_INPLACE, ALL_TO_ALL)


# ``torch._ops.OpOverload``: the type of ATen / custom op overloads in FX graphs (private module,
# no public alias), 2.11-2.14.
OpOverload = torch._ops.OpOverload


def disable_torch_function_subclass():
    """``torch._C.DisableTorchFunctionSubclass``: run an op below a ``__torch_function__``
    subclass (what torch's own subclasses use; private, 2.11-2.14)."""
    return torch._C.DisableTorchFunctionSubclass()


def fake_tensor_types():
    """(FakeTensor, FakeTensorMode): the fake values of graph nodes (private
    ``torch._subclasses``; no public alternative), 2.11-2.14."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor, FakeTensorMode


# ------------------------------------------------------------------------------- collectives


def all_gather(flat: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """All-gather a flat tensor into (world_size * numel,), waiting for the result."""
    return WAIT(ALL_GATHER(flat, world_size, group_name))


def reduce_scatter_sum(flat: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Sum-reduce-scatter a flat tensor of world_size * n elements into (n,)."""
    return WAIT(REDUCE_SCATTER(flat, "sum", world_size, group_name))


def all_reduce_sum(flat: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum-all-reduce a tensor over a group, waiting for the result."""
    return WAIT(ALL_REDUCE(flat, "sum", group_name))


def side_all_gather(out: torch.Tensor, inp: torch.Tensor, group, timeout_s: float) -> None:
    """Eager all-gather on a side group (``gloo_side_group``) with a bounded wait.

    The group is a bare gloo backend (not registered with ``torch.distributed``), driven through
    its own ``_allgather_base`` (2.11-2.14). ``Work.wait(timeout)`` raises on gloo once the
    timeout passes (checked 2.13, 2.14).
    """
    work = group._allgather_base(out, inp)
    work.wait(timedelta(seconds=timeout_s))


def gloo_side_group(prefix: str, ranks: list[int], timeout_s: float):
    """A gloo communicator of ``ranks`` (global ranks) that only those ranks create.

    ``dist.new_group`` must be entered by every rank of the job (or, with
    ``use_local_synchronization``, derives its store keys from how many groups each process made
    before, which differs between pipeline stages); torch's own debug wrapper builds its helper
    group the way done here: a ``ProcessGroupGloo`` over a ``PrefixStore`` of the default store,
    under a prefix the members agree on. Private constructor, stable 2.11-2.14.
    """
    from torch._C._distributed_c10d import ProcessGroupGloo

    store = default_store()
    if store is None:
        raise RuntimeError("zero3: the default process group has no store to rendezvous in")
    me = ranks.index(dist.get_rank())
    return ProcessGroupGloo(
        dist.PrefixStore(prefix, store), me, len(ranks), timedelta(seconds=max(timeout_s, 1.0))
    )


def register_wait(tensor: torch.Tensor, on_wait) -> None:
    """Make ``wait_tensor(tensor)`` call ``on_wait()`` (which blocks until the tensor is ready,
    and raises if it never will be), the way the functional collectives register their work.

    Private: ``_register_work`` with a ``PythonCallbackWork`` (2.13, 2.14), else a work made from
    a torch future completed by running ``on_wait`` on a helper thread (2.11, 2.12).
    """
    c10d = torch._C._distributed_c10d
    callback_work = getattr(c10d, "PythonCallbackWork", None)
    if callback_work is not None:

        def wait(timeout) -> bool:
            on_wait()
            return True

        c10d._register_work(tensor, callback_work(wait))
        return
    import threading

    done = torch.futures.Future()

    def run() -> None:
        try:
            on_wait()
            done.set_result([tensor])
        except BaseException as error:  # noqa: BLE001 - delivered to the waiter
            done.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    c10d._register_work(tensor, c10d._create_work_from_future(done))


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group of a name found in a graph. Private (``_resolve_process_group``) with no
    public equivalent; the functional collectives use it themselves. Checked 2.11-2.14."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def mesh_from_group(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    return DeviceMesh.from_group(group, device_type)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh of the dimensions of ``meshes`` (slices of one ``init_device_mesh``), as FSDP2
    builds its data-parallel x tensor-parallel mesh. ``DeviceMesh._concatenate`` is private (no
    public alternative); checked 2.13-2.14, present since 2.8."""
    try:
        return DeviceMesh._concatenate(meshes)
    except (RuntimeError, AttributeError, TypeError, AssertionError) as error:
        raise ValueError(
            "zero3: the data-parallel mesh and the tensor-parallel mesh of a DTensor parameter "
            f"must be named dimensions of one init_device_mesh ({error}); build "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), apply "
            "parallelize_module(model, mesh['tp'], plan) and call shard(model, mesh=mesh['dp'])"
        ) from error


def strided_shard(dim: int, split_factor: int):
    """``_StridedShard(dim, split_factor)``: a dim-0 chunk of each of ``split_factor`` chunks (the
    dp placement of a parameter TP shards along the same dimension, as FSDP2 stores it). Private
    placement, no public alternative; 2.11-2.14."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def group_backend(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def _group_or_none(group_name: str) -> dist.ProcessGroup | None:
    """The process group a graph names; None when the name resolves to no group of this process
    (a graph read offline)."""
    try:
        return resolve_group(group_name)
    except (KeyError, RuntimeError, ValueError):
        return None


def backend_of(group_name: str) -> str:
    """The backend of the process group a graph names ("gloo", "nccl", "fake"...), "" for none."""
    group = _group_or_none(group_name)
    return "" if group is None else group_backend(group)


def group_rank(group_name: str) -> int | None:
    """This process's rank in the process group a graph names; None for none."""
    group = _group_or_none(group_name)
    return None if group is None else group.rank()


def gloo_reduce_scatter_as_all_reduce(group_name: str) -> int | None:
    """This rank's index in ``group_name`` where its reduce-scatters are to be issued as in-place
    all-reduces of the copy-in's buffer (the caller keeps its own rows), else None: on gloo
    groups, unless ``ZERO3_GLOO_REDUCE_SCATTER=1``.

    gloo has no reduce-scatter of its own: its ``reduce_scatter_tensor`` all-reduces a copy of
    the whole input. The same all-reduce issued in place on the buffer the copy-in made moves
    the same bytes without that second full-size copy (1.5 GB for the tied embedding of a 3B
    Llama). ``ZERO3_GLOO_REDUCE_SCATTER=1`` issues gloo's own reduce-scatter, for comparisons.

    History: the heap corruptions of our soak runs on torch 2.14 were first blamed on gloo's
    reduce-scatter; ``bench/repros/gloo_reduce_scatter_race.py`` showed the trigger is any
    collectives in flight together, all-reduces too; the cure is ``passes/serialize.py`` (one
    gloo collective in flight).
    """
    choice = os.environ.get("ZERO3_GLOO_REDUCE_SCATTER", "")
    if choice not in ("", "0", "1"):
        raise ValueError(
            f"ZERO3_GLOO_REDUCE_SCATTER={choice!r}: use 1 (gloo's own reduce-scatter), 0 or leave "
            "it unset (an in-place all-reduce of the copy-in's buffer)"
        )
    if choice == "1" or backend_of(group_name) != "gloo":
        return None
    return resolve_group(group_name).rank()


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


def default_store() -> dist.Store | None:
    """The store the default process group was created with (None if unavailable).

    Private (``_get_default_store``); the public alternative is keeping the store you created,
    which a library cannot. Checked 2.11-2.14.
    """
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, ValueError):
        return None


# ------------------------------------------------------------------------------- DTensor shards


# (major, minor) of the running torch: read once (the probes below run on every shard read)
_TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2])


def to_local_keeps_missing_gradients() -> bool:
    """Whether ``DTensor.to_local()``'s backward leaves a missing gradient missing. torch 2.12
    to 2.14 do; 2.11 turns it into zeros (its ``_ToTorchTensor`` materializes gradients), so a
    parameter whose shard gets no gradient (sync off: the full gradient goes to the sink; an
    expert no token reached) would receive a zero gradient instead of none (an optimizer steps
    it, AccumulateGrad adds it to a pending gradient)."""
    return _TORCH >= (2, 12)


@functools.cache
def _local_shard_function():
    """torch 2.11's ``_ToTorchTensor`` (private ``torch.distributed.tensor._api``) with
    2.13's handling of a missing gradient: none in, none out."""
    from torch.distributed.tensor._api import _ToTorchTensor

    class LocalShard(_ToTorchTensor):
        @staticmethod
        def forward(ctx, dtensor):
            ctx.set_materialize_grads(False)
            return _ToTorchTensor.forward(ctx, dtensor, None)

        @staticmethod
        def backward(ctx, grad):
            return None if grad is None else _ToTorchTensor.backward(ctx, grad)[0]

    return LocalShard


def local_shard(dtensor) -> torch.Tensor:
    """``dtensor.to_local()`` (no ``grad_placements``) whose backward gives no gradient where
    none came, on every supported torch (``to_local_keeps_missing_gradients``). In a graph
    dynamo traces, the method call itself (``rewrite_to_local`` swaps it before AOTAutograd)."""
    if torch.compiler.is_compiling():
        return dtensor.to_local()
    if to_local_keeps_missing_gradients():
        # DTensor's own: an offloaded shard's to_local() hands users its store's values
        # (offload/access.py); here it is the shard's tensor itself
        from torch.distributed.tensor import DTensor

        return DTensor.to_local(dtensor)
    return _local_shard_function().apply(dtensor)


def allow_foreach(cls: type) -> None:
    """Let optimizers and ``clip_grad_norm_`` take their foreach paths over ``cls`` (a DTensor
    subclass) as over DTensor: the lists DTensor adds itself to (private
    ``torch.optim.optimizer._foreach_supported_types`` and ``torch.utils._foreach_utils``'s;
    no public registration), 2.11-2.14."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if cls not in supported:
            supported.append(cls)


def rewrite_to_local(gm, cache_key: str) -> bool:
    """On torch 2.11, replace ``x.to_local()`` calls of a dynamo graph (and its subgraphs) by
    ``local_shard(x)``; returns whether anything changed. ``cache_key`` keeps AOTAutograd's
    cache open to the call (its ``fx.wrap`` convention: ``is_wrapped`` with ``user_cache_hash``;
    an unknown function otherwise bypasses the cache)."""
    if to_local_keeps_missing_gradients():
        return False

    def swap(graph, node):
        if not (node.op == "call_method" and node.target == "to_local"):
            return None
        if len(node.args) != 1 or node.kwargs:
            return None  # to_local(grad_placements=...): torch's own
        call = graph.call_function(local_shard, node.args)
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


# ------------------------------------------------------------------------------- dynamo graphs


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


def set_grad_enabled_target():
    """What dynamo records for ``torch.no_grad()`` / ``enable_grad()`` regions."""
    return torch._C._set_grad_enabled


# ------------------------------------------------------------------------------- aot_autograd


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


def partitioner_base() -> type:
    """Base class of a partition function Inductor's ``custom_partitioner_fn`` accepts (private,
    ``torch._inductor.custom_graph_pass``, 2.11-2.14)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def aot_autograd_backend(**kwargs):
    """``torch._dynamo.backends.common.aot_autograd``: semi-public (documented for custom
    backends), 2.11-2.14."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


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
    return type(node).__name__ == "CompiledFunctionBackward"


# ------------------------------------------------------------------------------- inductor


def inductor_compile_fx():
    """``compile_fx`` / ``compile_fx_inner``: private, the only way to run Inductor on graphs we
    scheduled ourselves (2.11-2.14)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


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


def inductor_config_patches(mode: str | None) -> dict[str, Any]:
    """Inductor settings the scheduled graphs need.

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


# ------------------------------------------------------------------------------- fx and autograd


def nested_regions_take_dtensor_inputs() -> bool:
    """Whether dynamo traces a nested compile region (``invoke_subgraph``) whose body reads
    sharded (DTensor) parameters. torch 2.11 and 2.12 do not: their subgraph speculation asserts
    that every lifted input is a FakeTensor ("Expected FakeTensor, got DTensor"); 2.13 and 2.14
    do (all four checked)."""
    return _TORCH >= (2, 13)


def boxed_codegen():
    """FX codegen with the boxed calling convention (inputs freed as early as possible).
    Private ``torch.fx.graph._BoxedCodeGen``; present 2.11-2.14."""
    from torch.fx.graph import _BoxedCodeGen

    return _BoxedCodeGen()


def mark_side_effect(op) -> None:
    """Keep an op without users through FX and Inductor dead-code elimination
    (``torch.fx.node.has_side_effect``: public since 2.5)."""
    torch.fx.node.has_side_effect(op)


def storage_key(tensor: torch.Tensor):
    """A hashable handle of a tensor's storage (``StorageWeakRef``, private, 2.11-2.14)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


@functools.cache
def profiler_allocation_tag():
    """The profiler's allocation event tag (private ``torch._C._profiler._EventType``)."""
    from torch._C._profiler import _EventType

    return _EventType.Allocation


def trace_structured(*args, **kwargs) -> None:
    """``torch._logging.trace_structured`` (private; what tlparse reads), 2.11-2.14."""
    from torch._logging import trace_structured as trace

    trace(*args, **kwargs)


def register_dynamo_backend(fn, name: str) -> None:
    """Register a backend unless the entry point (or an import) did already."""
    from torch._dynamo.backends import registry

    # private tables: the public ``register_backend`` raises on a second registration
    if name in registry._COMPILER_FNS or registry._BACKENDS.get(name) is not None:
        return
    registry.register_backend(fn, name=name)


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
