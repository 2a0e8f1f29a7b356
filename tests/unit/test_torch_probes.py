"""One probe per entry of ``zero3_compile/_torch/``: the assumption each makes about torch.

Run on every supported torch (CI's newest-torch stage runs this file): on a torch that breaks an
assumption the failing probe names the entry (``_torch.<module>.<entry>``) and what no longer
holds, instead of a training run going wrong somewhere downstream. Single process, no launches:
the distributed entries run on the ``fake`` process group of 4 (``fake_pg``) or a one-rank gloo
group.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from zero3_compile._torch import (
    VERSION,
    aot_autograd,
    c10d,
    checkpoint,
    dtensor,
    dynamo,
    higher_order,
    inductor,
    modules,
    pipelining,
    pytree,
    tensors,
    tracing,
)
from zero3_compile._torch import autograd as torch_autograd
from zero3_compile._torch import fx as torch_fx


@contextlib.contextmanager
def assumption(entry: str, what: str):
    """Turn any failure inside the block into one that names the entry and its assumption."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any breakage is the entry's
        pytest.fail(
            f"zero3_compile._torch.{entry}: assumed {what}; not so on torch {torch.__version__}: "
            f"{type(error).__name__}: {error}"
        )


def _dtensor(local: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (4,))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


# ------------------------------------------------------------------------------- c10d


def test_c10d_functional_collective_ops():
    """signature.py and the passes read these ops' arguments by position."""
    expected = {
        c10d.ALL_GATHER: ["input", "group_size", "group_name"],
        c10d.REDUCE_SCATTER: ["input", "reduce_op", "group_size", "group_name"],
        c10d.ALL_REDUCE: ["input", "reduce_op", "group_name"],
        c10d.ALL_REDUCE_INPLACE: ["input", "reduce_op", "group_name"],
        c10d.ALL_TO_ALL: ["input", "output_split_sizes", "input_split_sizes", "group_name"],
        c10d.WAIT: ["tensor"],
    }
    with assumption(
        "c10d.ALL_GATHER/REDUCE_SCATTER/ALL_REDUCE/ALL_TO_ALL/WAIT",
        "torch.ops._c10d_functional ops take (input, [op,] [size,] group_name) in this order",
    ):
        for op, names in expected.items():
            got = [a.name for a in op._schema.arguments]
            # argument names differ between releases (reduceOp / reduce_op): positions matter
            assert len(got) == len(names), (op, got)
            assert got[0] in ("input", "tensor", "self"), (op, got)
            assert got[-1] == "group_name" or op is c10d.WAIT, (op, got)


def test_c10d_side_all_gather_and_gloo_side_group(monkeypatch):
    with assumption(
        "c10d.gloo_side_group/side_all_gather",
        "ProcessGroupGloo(PrefixStore, rank, size, timedelta) and its _allgather_base(out, inp) "
        "whose work waits with a timeout",
    ):
        monkeypatch.setattr(c10d, "default_store", lambda: dist.HashStore())
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        group = c10d.gloo_side_group("zero3_probe", [0], timeout_s=5.0)
        out = torch.zeros(3)
        c10d.side_all_gather(out, torch.arange(3.0), group, timeout_s=5.0)
        assert out.tolist() == [0.0, 1.0, 2.0]


def test_c10d_register_wait():
    with assumption(
        "c10d.register_wait",
        "wait_tensor(t) runs the work registered on t (_register_work / PythonCallbackWork)",
    ):
        calls = []
        t = torch.ones(2)
        c10d.register_wait(t, lambda: calls.append(1))
        c10d.WAIT(t)
        assert calls == [1]


def test_c10d_resolve_group_backend_of_group_rank(fake_pg):
    with assumption(
        "c10d.resolve_group/backend_of/group_rank",
        "distributed_c10d._resolve_process_group(name) gives the group a graph names",
    ):
        name = fake_pg.group_name
        assert c10d.resolve_group(name) is fake_pg
        assert c10d.backend_of(name) == "fake"
        assert c10d.group_rank(name) == 0
        assert c10d.backend_of("no such group") == "" and c10d.group_rank("nope") is None


def test_c10d_default_store(fake_pg):
    with assumption(
        "c10d.default_store", "distributed_c10d._get_default_store() gives the default store"
    ):
        store = c10d.default_store()
        assert store is not None and isinstance(store, dist.Store)


# ------------------------------------------------------------------------------- dtensor


def test_dtensor_concatenate_meshes(fake_pg):
    from torch.distributed.device_mesh import init_device_mesh

    with assumption(
        "dtensor.concatenate_meshes",
        "DeviceMesh._concatenate([mesh['dp'], mesh['tp']]) rebuilds the 2-D mesh",
    ):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        both = dtensor.concatenate_meshes([mesh["dp"], mesh["tp"]])
        assert both.mesh_dim_names == ("dp", "tp")
        assert both.mesh.tolist() == mesh.mesh.tolist()


def test_dtensor_strided_shard():
    from torch.distributed.tensor.placement_types import Placement

    with assumption(
        "dtensor.strided_shard", "_StridedShard(dim, split_factor=) is a placement of that dim"
    ):
        placement = dtensor.strided_shard(0, 2)
        assert isinstance(placement, Placement) and placement.dim == 0
        assert placement.split_factor == 2


class _NoGradient(torch.autograd.Function):
    """Passes its input through; its backward gives the input no gradient (a sync-off sink)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_dtensor_to_local_keeps_missing_gradients(fake_pg):
    with assumption(
        "dtensor.to_local_keeps_missing_gradients",
        "DTensor.to_local()'s backward leaves a missing gradient missing where it says so",
    ):
        shard = _dtensor(torch.ones(2)).requires_grad_()
        _NoGradient.apply(shard.to_local()).sum().backward()
        if dtensor.to_local_keeps_missing_gradients():
            assert shard.grad is None


def test_dtensor_local_shard(fake_pg):
    with assumption(
        "dtensor.local_shard",
        "_ToTorchTensor.forward(ctx, dtensor, grad_placements) / backward(ctx, grad) (2.11's "
        "fallback) read a shard and give no gradient where none came",
    ):
        # 2.11's fallback, probed where it is used
        fallbacks = (False,) if dtensor.to_local_keeps_missing_gradients() else (False, True)
        for fallback in fallbacks:
            shard = _dtensor(torch.arange(2.0)).requires_grad_()
            read = (
                dtensor._local_shard_function().apply(shard)
                if fallback
                else dtensor.local_shard(shard)
            )
            assert type(read) is torch.Tensor and read.tolist() == [0.0, 1.0]
            _NoGradient.apply(read).sum().backward()
            assert shard.grad is None
            shard.grad = None
            read = dtensor._local_shard_function().apply(shard) if fallback else shard.to_local()
            (read * 3).sum().backward()
            assert shard.grad.to_local().tolist() == [3.0, 3.0]


def test_dtensor_local_tensor(fake_pg):
    from torch.distributed.tensor import DTensor

    with assumption(
        "dtensor.local_tensor",
        "DTensor._local_tensor is the held tensor itself: no autograd edge, the same object on "
        "every read, a tensor subclass the DTensor was built around kept as it is",
    ):
        shard = _dtensor(torch.arange(2.0)).requires_grad_()
        held = dtensor.local_tensor(shard)
        assert type(held) is torch.Tensor and held.grad_fn is None
        assert held is dtensor.local_tensor(shard) and held.tolist() == [0.0, 1.0]
        inner = torch.ones(2).as_subclass(_Marked)
        built = DTensor(inner, dtensor.spec_of(shard), requires_grad=False)
        assert dtensor.local_tensor(built) is inner


class _Marked(torch.Tensor):
    """A plain tensor subclass (a stand-in for a GatheredParameter or a StoredTensor)."""


def test_dtensor_spec_of(fake_pg):
    from torch.distributed.tensor import DTensor

    with assumption(
        "dtensor.spec_of",
        "DTensor._spec has .mesh / .placements, and DTensor(local, spec, requires_grad=) builds "
        "a DTensor of that layout around local without a copy",
    ):
        shard = _dtensor(torch.arange(2.0))
        spec = dtensor.spec_of(shard)
        assert spec.mesh is shard.device_mesh and tuple(spec.placements) == shard.placements
        local = torch.tensor([5.0, 6.0])
        for requires_grad in (False, True):
            built = DTensor(local, spec, requires_grad=requires_grad)
            assert built.shape == shard.shape and built.placements == shard.placements
            assert built.requires_grad is requires_grad
            assert built.to_local().data_ptr() == local.data_ptr()


# ------------------------------------------------------------------------------- dynamo


@pytest.fixture(scope="module")
def traced(fake_pg):
    """One compile through ``aot_autograd_backend`` of a function with a shard read, a no_grad
    block, an activation-checkpointed region and a nested compile region: the dynamo graph and
    what the entries said inside the backend."""
    from torch.utils.checkpoint import checkpoint as activation_checkpoint

    regions = hasattr(torch.compiler, "nested_compile_region")
    region = torch.compiler.nested_compile_region(lambda x: x.cos() * 2) if regions else None

    def fn(shard, x):
        local = shard.to_local()
        with torch.no_grad():
            scale = x.sum()
        y = activation_checkpoint(lambda t: t.sin() * local, x, use_reentrant=False)
        if region is not None:  # called twice: dynamo inlines a region used once
            y = y + region(x) * region(x + 1)
        return y * scale

    seen = {}

    def backend(gm, example_inputs):
        seen["graph"] = gm
        seen["count"] = dynamo.dynamo_compile_count()
        seen["code"] = gm.code
        return dynamo.aot_autograd_backend(fw_compiler=_eager, bw_compiler=_eager)(
            gm, example_inputs
        )

    torch._dynamo.reset()
    shard = _dtensor(torch.arange(2.0) + 1).requires_grad_()
    x = torch.tensor([0.5, 1.5], requires_grad=True)
    with assumption(
        "dynamo (the probes' shared compile)",
        "dynamo and AOTAutograd compile a shard read, a no_grad block, an activation checkpoint "
        "and a nested compile region as one graph",
    ):
        out = torch.compile(fn, backend=backend, fullgraph=True)(shard, x)
    eager_shard = _dtensor(torch.arange(2.0) + 1).requires_grad_()
    want = fn(eager_shard, x)
    seen.update(out=out, want=want, outside=dynamo.dynamo_compile_count(), regions=regions)
    return seen


def _eager(gm, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def test_dynamo_aot_autograd_backend(traced):
    with assumption(
        "dynamo.aot_autograd_backend",
        "torch._dynamo.backends.common.aot_autograd(fw_compiler=, bw_compiler=) is a backend",
    ):
        assert torch.allclose(traced["out"], traced["want"])


def test_dynamo_dynamo_compile_count(traced):
    with assumption(
        "dynamo.dynamo_compile_count",
        "torch._guards.CompileContext.current_compile_id() has frame_id / frame_compile_id "
        "(from 0) inside a backend and is None outside",
    ):
        frame, count, limit = traced["count"]
        assert isinstance(frame, int) and count == 1
        assert limit == int(torch._dynamo.config.recompile_limit)
        assert traced["outside"] is None


def test_dynamo_register_dynamo_backend():
    from torch._dynamo.backends import registry

    with assumption(
        "dynamo.register_dynamo_backend",
        "the backend registry keeps _COMPILER_FNS / _BACKENDS and register_backend(fn, name=)",
    ):

        def probe_backend(gm, example_inputs):
            return gm

        dynamo.register_dynamo_backend(probe_backend, "zero3_probe_backend")
        dynamo.register_dynamo_backend(probe_backend, "zero3_probe_backend")  # a no-op
        assert registry.lookup_backend("zero3_probe_backend") is probe_backend


def test_dynamo_is_compiled_module():
    with assumption(
        "dynamo.is_compiled_module",
        "torch.compile(module) is an OptimizedModule; module.compile() sets _compiled_call_impl",
    ):
        plain = nn.Linear(2, 2)
        assert not dynamo.is_compiled_module(plain)
        assert dynamo.is_compiled_module(torch.compile(plain))
        in_place = nn.Linear(2, 2)
        in_place.compile()
        assert dynamo.is_compiled_module(in_place)


def test_dynamo_uncompiled():
    with assumption("dynamo.uncompiled", "torch.compile(module) keeps the module as ._orig_mod"):
        plain = nn.Linear(2, 2)
        assert dynamo.uncompiled(torch.compile(plain)) is plain
        assert dynamo.uncompiled(plain) is plain


def test_dynamo_compiled_function_original():
    def fn(x):
        return x + 1

    with assumption(
        "dynamo.compiled_function_original",
        "torch.compile(fn) keeps fn as ._torchdynamo_orig_callable",
    ):
        assert dynamo.compiled_function_original(torch.compile(fn, backend="eager")) is fn
        assert dynamo.compiled_function_original(fn) is None


def test_dynamo_inner_backend():
    """tools/inspect/explain.py finds a module's or a function's backend object (its name, the
    options it was given) by walking dynamo's wrappers from the compiled callable inward."""

    def probe_backend(gm, example_inputs, options=None):
        return gm.forward

    def backend_object(start):
        callback = start
        for _ in range(8):
            if getattr(callback, "compiler_name", None) == "zero3_probe_inner":
                return callback
            callback = dynamo.inner_backend(callback)
        return None

    with assumption(
        "dynamo.inner_backend",
        "dynamo's backend wrappers keep the next one inside as ._torchdynamo_orig_backend / "
        "._torchdynamo_orig_callable, down to the object naming the backend (compiler_name, "
        "kwargs) within 8 steps, from a module's dynamo_ctx.callback or a function's closure",
    ):
        dynamo.register_dynamo_backend(probe_backend, "zero3_probe_inner")
        module = torch.compile(nn.Linear(2, 2), backend="zero3_probe_inner", options={"k": 1})
        found = backend_object(module.dynamo_ctx.callback)
        assert found is not None and found.kwargs["options"] == {"k": 1}
        compiled = torch.compile(lambda x: x, backend="zero3_probe_inner", options={"k": 2})
        found = backend_object(inspect.getclosurevars(compiled).nonlocals.get("callback"))
        assert found is not None and found.kwargs["options"] == {"k": 2}


def test_dynamo_nested_regions_take_dtensor_inputs(fake_pg):
    if not dynamo.nested_regions_take_dtensor_inputs():
        pytest.skip("the entry says this torch cannot (z3.compile_once refuses)")
    with assumption(
        "dynamo.nested_regions_take_dtensor_inputs",
        "a nested compile region whose body reads a DTensor compiles (fullgraph) and runs",
    ):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            aot = dynamo.aot_autograd_backend(fw_compiler=_eager, bw_compiler=_eager)
            return aot(gm, example_inputs)

        class Block(nn.Module):  # as compile_once marks a block: its class's forward
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(_dtensor(torch.arange(2.0)))

            @torch.compiler.nested_compile_region
            def forward(self, x):
                return self.weight.to_local().exp() * x

        block = Block()  # called twice: dynamo inlines a region used once
        torch._dynamo.reset()
        out = torch.compile(lambda x: block(block(x)), backend=backend, fullgraph=True)(
            torch.ones(2)
        )
        out.sum().backward()
        # (dynamo may inline the region here; the claim is that tracing it does not fail)
        assert torch.allclose(out, torch.arange(2.0).exp() ** 2)
        assert block.weight.grad is not None


def test_dynamo_set_grad_enabled_target(traced):
    with assumption(
        "dynamo.set_grad_enabled_target",
        "dynamo records a no_grad block as calls of torch._C._set_grad_enabled(False/True)",
    ):
        calls = [
            n.args
            for n in traced["graph"].graph.nodes
            if n.target is dynamo.set_grad_enabled_target()
        ]
        assert (False,) in calls and (True,) in calls


def test_dynamo_is_dtensor_to_local_and_normalize_to_local(traced):
    with assumption(
        "dynamo.is_dtensor_to_local/normalize_to_local",
        "dynamo records DTensor.to_local() as a to_local method call (2.13+) or a "
        "prim_to_local closure without captured arguments (2.11, 2.12)",
    ):
        gm = traced["graph"]
        reads = [n for n in gm.graph.nodes if dynamo.is_dtensor_to_local(n)]
        assert reads, gm.code
        for node in reads:
            if node.op == "call_function":
                cells = [c.cell_contents for c in node.target.__closure__ or ()]
                assert not any(cells), cells
        copy = fx.GraphModule(gm, _copy_graph(gm.graph))
        changed = dynamo.normalize_to_local(copy)
        assert changed == any(n.op == "call_function" for n in reads)
        assert all(n.op == "call_method" for n in copy.graph.nodes if dynamo.is_dtensor_to_local(n))


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def test_dynamo_rewrite_to_local(traced, monkeypatch):
    with assumption(
        "dynamo.rewrite_to_local",
        "a dynamo graph with its to_local calls replaced by local_shard runs the same",
    ):
        gm = traced["graph"]
        copy = fx.GraphModule(gm, _copy_graph(gm.graph))
        dynamo.normalize_to_local(copy)
        monkeypatch.setattr(dtensor, "to_local_keeps_missing_gradients", lambda: False)
        assert dynamo.rewrite_to_local(copy, "probe")
        calls = [n for n in copy.graph.nodes if n.target is dtensor.local_shard]
        assert calls and all(n.meta["is_wrapped"] for n in calls)


# ------------------------------------------------------------------------------- higher-order ops


def test_higher_order_checkpoint_hops(traced):
    with assumption(
        "higher_order.checkpoint_hops",
        "dynamo records torch.utils.checkpoint as a higher-order op whose args[0] is a get_attr "
        "of the body's GraphModule",
    ):
        gm = traced["graph"]
        hops = [n for n in gm.graph.nodes if n.target in higher_order.checkpoint_hops()]
        assert hops, gm.code
        for node in hops:
            assert node.args[0].op == "get_attr"
            assert isinstance(getattr(gm, node.args[0].target), fx.GraphModule)


def test_higher_order_invoke_subgraph_op(traced):
    with assumption(
        "higher_order.invoke_subgraph_op",
        "a nested compile region is recorded as torch.ops.higher_order.invoke_subgraph",
    ):
        op = higher_order.invoke_subgraph_op()
        if not traced["regions"]:
            pytest.skip("no nested_compile_region on this torch")
        assert op is not None
        assert any(n.target is op for n in traced["graph"].graph.nodes), traced["code"]


def test_higher_order_region_schemas_cached():
    with assumption(
        "higher_order.region_schemas_cached",
        "InvokeSubgraphHOP defines gen_schema(self, subgraph, identifier, *operands)",
    ):
        if higher_order.invoke_subgraph_op() is None:
            pytest.skip("no invoke_subgraph on this torch")
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

        original = InvokeSubgraphHOP.__dict__["gen_schema"]
        params = list(inspect.signature(original).parameters.values())
        assert [p.name for p in params[:3]] == ["self", "subgraph", "identifier"]
        assert params[3].kind is inspect.Parameter.VAR_POSITIONAL
        with higher_order.region_schemas_cached():
            assert InvokeSubgraphHOP.__dict__["gen_schema"] is not original
        assert InvokeSubgraphHOP.__dict__["gen_schema"] is original


# ------------------------------------------------------------------------------- aot_autograd


def test_aot_autograd_min_cut_partition_and_order_saved_values():
    """AOTAutograd slices the forward's saved values as [tensors checked for version changes,
    tensors not checked, opaque objects, symbolic ints] and the backward takes the symbolic ints
    first: order_saved_values re-sorts both to that layout, so gradients stay right."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    seen = {}

    def partition(gm, joint_inputs, **kwargs):
        fw, bw = aot_autograd.min_cut_partition(gm, joint_inputs, **kwargs)
        aot_autograd.order_saved_values(fw, bw, kwargs["num_fwd_outputs"])
        seen.update(fw=fw, bw=bw, n=kwargs["num_fwd_outputs"])
        return fw, bw

    def f(x, w):
        return ((x.sin() @ w).relu() * x.shape[0]).sum(0)

    def compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    with assumption(
        "aot_autograd.min_cut_partition/order_saved_values/saved_value_group",
        "min_cut_rematerialization_partition(gm, joint_inputs, num_fwd_outputs=...) and "
        "AOTAutograd's saved-value layout (tensors, no-vc tensors, opaque, symints last; the "
        "backward's symint placeholders first)",
    ):
        compiled = aot_function(
            f, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition, dynamic=True
        )
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 5, requires_grad=True)
        compiled(x, w).sum().backward()
        got = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        f(x, w).sum().backward()
        assert torch.allclose(got[0], x.grad) and torch.allclose(got[1], w.grad)
        output = next(n for n in reversed(seen["fw"].graph.nodes) if n.op == "output")
        groups = [aot_autograd.saved_value_group(n) for n in output.args[0][seen["n"] :]]
        assert groups == sorted(groups), groups
        placeholders = [n for n in seen["bw"].graph.nodes if n.op == "placeholder"]
        syms = groups.count(3)
        assert all(aot_autograd.saved_value_group(p) == 3 for p in placeholders[:syms])
        if VERSION >= (2, 13):
            from torch._functorch._aot_autograd.graph_compile import is_opaque_node

            assert callable(is_opaque_node)


def test_aot_autograd_autograd_cache_disabled():
    from torch._functorch import config

    with assumption(
        "aot_autograd.autograd_cache_disabled",
        "torch._functorch.config.patch(enable_autograd_cache=False)",
    ):
        before = config.enable_autograd_cache
        with aot_autograd.autograd_cache_disabled():
            assert config.enable_autograd_cache is False
        assert config.enable_autograd_cache == before


def test_aot_autograd_compiled_function_node_and_offset():
    from functorch.compile import make_boxed_func

    def compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    with assumption(
        "aot_autograd.is_compiled_function_node/compiled_function_offset",
        "a compiled graph's outputs hang off a CompiledFunctionBackward node whose _forward_cls "
        ".metadata.num_mutated_inp_runtime_indices counts the inputs it mutates at runtime",
    ):
        backend = dynamo.aot_autograd_backend(fw_compiler=compiler, bw_compiler=compiler)
        torch._dynamo.reset()
        x = torch.randn(3, requires_grad=True)
        out = torch.compile(lambda t: t.sin() * 2, backend=backend)(x)
        node = out.grad_fn
        assert aot_autograd.is_compiled_function_node(node), type(node)
        assert aot_autograd.compiled_function_offset(node) == 0
        assert not aot_autograd.is_compiled_function_node(x.sin().grad_fn)


def test_aot_autograd_mark_boxed():
    seen = []

    def compiler(gm, example_inputs):
        forward = gm.forward

        def run(args):
            seen.append(type(args))
            out = forward(*args)
            args.clear()
            return out

        return aot_autograd.mark_boxed(run)

    with assumption(
        "aot_autograd.mark_boxed",
        "a compiled graph with ._boxed_call = True is called with one list of its inputs",
    ):
        backend = dynamo.aot_autograd_backend(fw_compiler=compiler, bw_compiler=compiler)
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        out = torch.compile(lambda t: (t * 3).sin(), backend=backend, fullgraph=True)(x)
        out.sum().backward()
        assert torch.allclose(out, (x * 3).sin()) and torch.allclose(x.grad, 3 * (x * 3).cos())
        assert seen and all(kind is list for kind in seen)


# ------------------------------------------------------------------------------- inductor


def test_inductor_inductor_compile_fx():
    with assumption(
        "inductor.inductor_compile_fx",
        "compile_fx(gm, example_inputs, inner_compile=, config_patches=) and "
        "compile_fx_inner(gm, example_inputs, **kwargs)",
    ):
        compile_fx, compile_fx_inner = inductor.inductor_compile_fx()
        params = inspect.signature(compile_fx).parameters
        assert {"inner_compile", "config_patches"} <= set(params)
        assert list(inspect.signature(compile_fx_inner).parameters)[:2] == [
            "gm",
            "example_inputs",
        ]


def test_inductor_partitioner_base():
    import torch._inductor.config as inductor_config

    with assumption(
        "inductor.partitioner_base",
        "CustomPartitionerFn's abstract methods are __call__ and uuid; Inductor's config has "
        "custom_partitioner_fn",
    ):
        base = inductor.partitioner_base()
        assert base.__abstractmethods__ == frozenset({"__call__", "uuid"})
        assert "custom_partitioner_fn" in inductor_config.get_config_copy()


def test_inductor_inductor_config_patches():
    import torch._inductor.config as inductor_config

    with assumption(
        "inductor.inductor_config_patches",
        "torch._inductor.config has the keys patched (reorder_for_peak_memory, "
        "reorder_for_locality, ...) and list_mode_options(mode)",
    ):
        for mode in (None, "max-autotune"):
            patches = inductor.inductor_config_patches(mode)
            known = inductor_config.get_config_copy()
            assert set(patches) <= set(known), set(patches) - set(known)
            with inductor_config.patch(patches):
                assert inductor_config.reorder_for_peak_memory is False


def test_inductor_stable_mesh_cache_keys(fake_pg):
    from torch._inductor.codecache import FxGraphCachePickler
    from torch.distributed.device_mesh import init_device_mesh

    with assumption(
        "inductor.stable_mesh_cache_keys",
        "FxGraphCachePickler.__init__ builds a per-instance dispatch_table dict, and dumps() "
        "pickles a DeviceMesh through it",
    ):
        inductor.stable_mesh_cache_keys()
        inductor.stable_mesh_cache_keys()  # once per process
        assert getattr(FxGraphCachePickler.__init__, "_zero3_stable_meshes", False)
        gm = fx.symbolic_trace(lambda x: x + 1)
        mesh = init_device_mesh("cpu", (4,))
        hash(mesh)  # the per-process hash the key must not hold
        pickler = FxGraphCachePickler(gm)
        assert isinstance(pickler.dispatch_table, dict)
        assert pickler.dispatch_table.get(type(mesh)) is inductor._mesh_cache_key
        first = pickler.dumps(mesh)
        assert FxGraphCachePickler(gm).dumps(init_device_mesh("cpu", (4,))) == first


def test_inductor_generated_wrapper_code(fake_pg):
    """The shape of Inductor's generated wrapper code that generated_events /
    generated_collective_order read: collective calls assigned to buffers, size asserts, waits,
    and the all_reduce Inductor re-inplaces."""
    name = fake_pg.group_name
    sources = []
    compile_fx, compile_fx_inner = inductor.inductor_compile_fx()

    def inner(gm, inputs, **kwargs):
        compiled = compile_fx_inner(gm, inputs, **kwargs)
        sources.append(getattr(compiled, "source_code", None))
        return compiled

    def backend(gm, example_inputs):
        patches = inductor.inductor_config_patches(None)
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    def fn(x):
        gathered = c10d.WAIT(c10d.ALL_GATHER(x, 4, name))
        reduced = c10d.WAIT(c10d.REDUCE_SCATTER(gathered, "sum", 4, name))
        return c10d.WAIT(c10d.ALL_REDUCE(reduced, "sum", name))

    with assumption(
        "inductor.generated_events/generated_collective_order",
        "compile_fx_inner's result has .source_code, a wrapper whose def call(...) assigns each "
        "collective to a buffer (bufN = torch.ops._c10d_functional.<op>.default(...)), asserts "
        "its size with assert_size_stride and waits with wait_tensor.default(bufN)",
    ):
        torch._dynamo.reset()
        with aot_autograd.autograd_cache_disabled():  # a cache hit skips inner_compile
            torch.compile(fn, backend=backend, fullgraph=True)(torch.ones(2))
        (source,) = sources
        assert isinstance(source, str) and "def call(" in source
        order = inductor.generated_collective_order(source)
        assert [kind for kind, _ in order] == ["all_gather", "reduce_scatter", "all_reduce"], order
        assert [n for _, n in order][:2] == [8, 2], order
        events = inductor.generated_events(source)
        assert [e for e in events if e[0] == "issue"] == [("issue", i) for i in range(3)], events
        assert ("wait", 0) in events and ("wait", 1) in events, events


# ------------------------------------------------------------------------------- fx


def test_fx_op_overload():
    with assumption("fx.OpOverload", "torch._ops.OpOverload is the type of op overloads"):
        assert isinstance(torch.ops.aten.add.Tensor, torch_fx.OpOverload)
        assert isinstance(c10d.WAIT, torch_fx.OpOverload)
        assert c10d.WAIT.namespace == "_c10d_functional"


def test_fx_fake_tensor_types():
    with assumption(
        "fx.fake_tensor_types", "torch._subclasses.fake_tensor's FakeTensor / FakeTensorMode"
    ):
        fake_tensor, fake_mode = torch_fx.fake_tensor_types()
        with fake_mode():
            value = torch.empty(2, 3)
        assert isinstance(value, fake_tensor) and value.shape == (2, 3)


def test_fx_torch_dispatch_mode():
    with assumption(
        "fx.TorchDispatchMode",
        "a TorchDispatchMode subclass sees each ATen call in __torch_dispatch__",
    ):
        seen = []

        class Recorder(torch_fx.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        with Recorder():
            torch.ones(2) + 1
        assert torch.ops.aten.add.Tensor in seen


def test_fx_boxed_codegen():
    with assumption(
        "fx.boxed_codegen",
        "torch.fx.graph._BoxedCodeGen: forward takes one list of inputs and empties it",
    ):
        gm = fx.symbolic_trace(lambda x, y: x + y)
        gm.graph.set_codegen(torch_fx.boxed_codegen())
        gm.recompile()
        args = [torch.ones(1), torch.ones(1)]
        assert gm.forward(args).item() == 2.0
        assert args == []


def test_fx_schema_of():
    with assumption(
        "fx.schema_of",
        "OpOverload._schema: arguments (name, alias_info.is_write), returns, is_mutable",
    ):
        written = torch_fx.schema_of(torch.ops.aten.add_.Tensor)
        assert [a.name for a in written.arguments][:2] == ["self", "other"]
        assert written.arguments[0].alias_info.is_write and written.is_mutable
        assert written.arguments[1].alias_info is None
        view = torch_fx.schema_of(torch.ops.aten.view.default)
        assert not view.is_mutable and view.returns[0].alias_info is not None
        assert torch_fx.schema_of(torch.ops.aten.add.Tensor).returns[0].alias_info is None


def test_fx_node_name():
    with assumption(
        "fx.node_name",
        "Graph._target_to_str(name) snake-cases a name and drops magic underscores",
    ):
        graph = fx.Graph()
        assert torch_fx.node_name(graph, "allGather") == "all_gather"
        assert torch_fx.node_name(graph, "__add__") == "add"
        node = graph.create_node(
            "call_function", torch.add, (), {}, name=torch_fx.node_name(graph, "wait_tensor")
        )
        assert node.name == "wait_tensor"


# ------------------------------------------------------------------------------- tensors


def test_tensors_make_wrapper_subclass():
    class Holder(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    with assumption(
        "tensors.make_wrapper_subclass",
        "torch.Tensor._make_wrapper_subclass(cls, shape, strides=, dtype=, device=, "
        "requires_grad=) makes a storage-less instance",
    ):
        value = tensors.make_wrapper_subclass(
            Holder, (2, 3), strides=(3, 1), dtype=torch.bfloat16, device="cpu", requires_grad=False
        )
        assert type(value) is Holder and value.shape == (2, 3) and value.stride() == (3, 1)
        assert value.dtype == torch.bfloat16 and not value.requires_grad


def test_tensors_disable_torch_function_subclass():
    calls = []

    class Counting(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    with assumption(
        "tensors.disable_torch_function_subclass",
        "torch._C.DisableTorchFunctionSubclass() skips a subclass's __torch_function__",
    ):
        value = torch.ones(2).as_subclass(Counting)
        calls.clear()
        with tensors.disable_torch_function_subclass():
            value + 1
        assert calls == []
        value + 1
        assert calls


def test_tensors_storage_key():
    with assumption(
        "tensors.storage_key", "StorageWeakRef: equal and hashable for views of one storage"
    ):
        base = torch.ones(4)
        assert tensors.storage_key(base) == tensors.storage_key(base[1:])
        assert hash(tensors.storage_key(base)) == hash(tensors.storage_key(base.view(2, 2)))
        assert tensors.storage_key(base) != tensors.storage_key(torch.ones(4))


def test_tensors_allow_foreach():
    from torch.distributed.tensor import DTensor
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    class Sub(DTensor):
        pass

    lists = (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    with assumption(
        "tensors.allow_foreach",
        "optimizer._foreach_supported_types and _foreach_utils._foreach_supported_types are "
        "the lists DTensor adds itself to",
    ):
        try:
            for supported in lists:
                assert DTensor in supported
            tensors.allow_foreach(Sub)
            tensors.allow_foreach(Sub)
            assert all(supported.count(Sub) == 1 for supported in lists)
        finally:
            for supported in lists:
                while Sub in supported:
                    supported.remove(Sub)


def test_tensors_version():
    with assumption(
        "tensors.version",
        "Tensor._version counts in-place writes, shared by views, not by out-of-place ops; a "
        ".data view counts its own",
    ):
        base = torch.zeros(4)
        before = tensors.version(base)
        base + 1
        assert tensors.version(base) == before
        base[1:].add_(1)
        assert tensors.version(base) > before
        assert tensors.version(base[1:]) == tensors.version(base)
        now = tensors.version(base)
        base.data.add_(1)
        assert tensors.version(base) == now


# ------------------------------------------------------------------------------- modules


def test_modules_own_parameters():
    with assumption(
        "modules.own_parameters",
        "nn.Module._parameters is the registry dict (registration order, None entries): a "
        "parameter put in it is what the module reads and reports",
    ):
        module = nn.Linear(2, 2)
        module.register_parameter("extra", None)
        registry = modules.own_parameters(module)
        assert registry is modules.own_parameters(module)
        assert list(registry) == ["weight", "bias", "extra"] and registry["extra"] is None
        new = nn.Parameter(torch.zeros(2, 2))
        registry["weight"] = new
        assert module.weight is new and dict(module.named_parameters())["weight"] is new
        assert "weight" not in module.__dict__
        assert torch.equal(module(torch.ones(1, 2)), module.bias.detach().view(1, 2))


def test_modules_own_buffers_and_non_persistent_buffer_names():
    with assumption(
        "modules.own_buffers/non_persistent_buffer_names",
        "nn.Module._buffers is the registry dict of own buffers; _non_persistent_buffers_set "
        "names those state_dict() leaves out",
    ):
        module = nn.BatchNorm1d(2)
        module.register_buffer("scratch", torch.ones(1), persistent=False)
        own = modules.own_buffers(module)
        assert own is modules.own_buffers(module)
        assert list(own) == ["running_mean", "running_var", "num_batches_tracked", "scratch"]
        assert modules.non_persistent_buffer_names(module) == {"scratch"}
        assert "scratch" not in module.state_dict() and "running_mean" in module.state_dict()


def test_modules_own_children():
    with assumption(
        "modules.own_children",
        "nn.Module._modules is the dict of direct submodules by attribute name",
    ):
        outer = nn.Module()
        outer.experts = nn.ModuleList([nn.Linear(1, 1)])
        outer.register_module("absent", None)
        children = modules.own_children(outer)
        assert children is modules.own_children(outer)
        assert list(children) == ["experts", "absent"] and children["experts"] is outer.experts


def test_modules_rnn_flat_weight_names():
    with assumption(
        "modules.rnn_flat_weight_names",
        "RNNBase._flat_weights_names lists its weight attributes in _flat_weights' order, and "
        "RNNBase still has the methods frontend/rnn.py replaces (_flat_weights, "
        "_init_flat_weights, _update_flat_weights, _weights_have_changed, flatten_parameters)",
    ):
        rnn = nn.LSTM(2, 3, num_layers=2)
        names = modules.rnn_flat_weight_names(rnn)
        assert names[:4] == ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"]
        assert len(names) == 8 and all(name in modules.own_parameters(rnn) for name in names)
        assert [w is getattr(rnn, n) for w, n in zip(rnn._flat_weights, names)] == [True] * 8
        for name in (
            "_init_flat_weights",
            "_update_flat_weights",
            "_weights_have_changed",
            "flatten_parameters",
        ):
            assert callable(getattr(nn.RNNBase, name)), name


# ------------------------------------------------------------------------------- the rest


def test_autograd_queue_callback():
    with assumption(
        "autograd.queue_callback",
        "Variable._execution_engine.queue_callback(f) runs f once the backward has finished",
    ):
        x = torch.ones(2, requires_grad=True)
        seen = []

        def hook(grad):
            torch_autograd.queue_callback(lambda: seen.append(x.grad))
            return grad

        y = x * 2
        y.register_hook(hook)
        y.sum().backward()
        assert len(seen) == 1 and seen[0] is not None and seen[0].tolist() == [2.0, 2.0]


def test_pytree():
    with assumption("pytree", "torch.utils._pytree's tree_map / tree_flatten / tree_leaves"):
        tree = {"a": [torch.ones(1), (torch.zeros(1), 3)]}
        assert len(pytree.tree_leaves(tree)) == 3
        leaves, spec = pytree.tree_flatten(tree)
        assert len(leaves) == 3 and spec.num_leaves == 3
        doubled = pytree.tree_map(lambda v: v * 2, tree)
        assert doubled["a"][0].item() == 2.0 and doubled["a"][1][1] == 6


def test_tracing_trace_structured():
    with assumption(
        "tracing.trace_structured",
        "torch._logging.trace_structured(name, metadata_fn=, payload_fn=)",
    ):
        tracing.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "zero3_probe", "encoding": "string"},
            payload_fn=lambda: "probe",
        )


def test_tracing_cpu_allocations():

    with assumption(
        "tracing.cpu_allocations/profiler_allocation_tag",
        "a memory profile's kineto_results.experimental_event_tree() holds allocation events "
        "(tag _EventType.Allocation, extra_fields.device / alloc_size)",
    ):
        # in a fresh process: an earlier test of the suite may have left the offload host cache
        # installed as the CPU allocator in this one, and its allocations bypass the profiler
        code = (
            "import torch\n"
            "from torch.profiler import ProfilerActivity, profile\n"
            "from zero3_compile._torch import tracing\n"
            "with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:\n"
            "    kept = torch.empty(1 << 20, dtype=torch.uint8)\n"
            "print(max([size for _, size in tracing.cpu_allocations(prof)], default=0))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout.split()[-1]) >= 1 << 20, out.stdout


def test_checkpoint_no_optimizer_state_init():
    from torch.distributed.checkpoint import state_dict

    with assumption(
        "checkpoint.no_optimizer_state_init",
        "torch.distributed.checkpoint.state_dict._init_optim_state(optim) creates the state of "
        "an optimizer without state (a zero-lr step) and is looked up as a module global",
    ):
        model = nn.Linear(2, 2)
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        with checkpoint.no_optimizer_state_init():
            state_dict._init_optim_state(adam)
            assert not adam.state
        state_dict._init_optim_state(adam)
        assert adam.state
        # called by name from get/set_state_dict's helpers, so patching the global reaches them
        assert inspect.getsource(state_dict).count("_init_optim_state(") >= 2


def test_checkpoint_metadata_path(tmp_path):
    import torch.distributed.checkpoint as dcp

    with assumption(
        "checkpoint.metadata_path",
        "FileSystemReader._get_metadata_path(rank) is where a save writes .metadata "
        "(__{rank}.metadata for a rank's own)",
    ):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
        reader = dcp.FileSystemReader(str(tmp_path))
        assert str(checkpoint.metadata_path(reader)) == str(tmp_path / ".metadata")
        assert (tmp_path / ".metadata").exists()
        assert str(checkpoint.metadata_path(reader, 3)).endswith("__3.metadata")


def test_pipelining_split_backward_types():
    from torch.distributed.pipelining import schedules

    with assumption(
        "pipelining.split_backward_types",
        "schedule actions carry computation_type; _ComputationType has BACKWARD_INPUT and "
        "BACKWARD_WEIGHT",
    ):
        kinds = pipelining.split_backward_types()
        assert {kind.name for kind in kinds} == {"BACKWARD_INPUT", "BACKWARD_WEIGHT"}
        assert "computation_type" in schedules._Action._fields


def test_pipelining_metadata_cleanup_hook():
    """parallel/pipelining.py's PipelineStage overrides this hook (allowed in test_layers.py)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    with assumption(
        "(parallel.pipelining's override) PipelineStage._post_metadata_inference_cleanup",
        "a stage has the hook and the schedules call it on each stage",
    ):
        assert callable(PipelineStage._post_metadata_inference_cleanup)
        assert "._post_metadata_inference_cleanup()" in inspect.getsource(schedules)
