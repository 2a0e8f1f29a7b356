"""``explain``: compile a model with the zero3 backend and report what was done to every graph."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..._torch.dynamo import compiled_function_original, inner_backend, uncompiled
from ..._torch.pytree import tree_leaves
from ...compiler.options import Options
from ...compiler.recording import record_graphs
from ...sharding.state import is_sharded
from .report import GraphReport, budget_summary, build_report, step_peak_bytes


@dataclass
class ExplainReport:
    """One ``GraphReport`` per compiled graph (forward, backward, inference), in compile order."""

    graphs: list[GraphReport] = field(default_factory=list)

    def by_kind(self, kind: str) -> list[GraphReport]:
        return [g for g in self.graphs if g.kind == kind]

    @property
    def estimated_step_peak_bytes(self) -> int:
        """Peak memory of one training step above what is allocated before it (params, inputs)."""
        forwards, backwards = self.by_kind("forward"), self.by_kind("backward")
        if not forwards:
            return max((g.peak_bytes for g in self.graphs), default=0)
        return max(
            step_peak_bytes(f, b) for f, b in zip(forwards, backwards + [None] * len(forwards))
        )

    @property
    def communication_bytes(self) -> dict[str, int]:
        """Logical bytes per step by collective kind (all-gather output, reduce-scatter input)."""
        totals: dict[str, int] = {}
        for graph in self.graphs:
            for kind, stats in graph.collectives.items():
                totals[kind] = totals.get(kind, 0) + stats["bytes"]
        return totals

    def __str__(self) -> str:
        mib = 2**20
        header = (
            f"zero3 explain: {len(self.graphs)} graph(s); estimated step peak "
            f"{self.estimated_step_peak_bytes / mib:.2f} MiB above the persistent state; "
            + ", ".join(
                f"{k} {v / mib:.3f} MiB" for k, v in sorted(self.communication_bytes.items())
            )
        )
        budgets = [budget_summary(g.budget) for g in self.graphs if g.budget is not None]
        return "\n".join([header, *budgets, *(str(g) for g in self.graphs)])

    def to_dict(self) -> dict:
        return {
            "estimated_step_peak_bytes": self.estimated_step_peak_bytes,
            "communication_bytes": self.communication_bytes,
            "graphs": [g.to_dict() for g in self.graphs],
        }

    def save(self, folder: str, pictures: bool = True) -> list[str]:
        """Write report.txt, report.json and (with matplotlib) one picture per graph."""
        os.makedirs(folder, exist_ok=True)
        written = [os.path.join(folder, "report.txt"), os.path.join(folder, "report.json")]
        with open(written[0], "w") as f:
            f.write(str(self) + "\n")
        with open(written[1], "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        if pictures:
            from .plot import plot_graph

            for graph in self.graphs:
                path = os.path.join(folder, f"graph{graph.graph_id}_{graph.kind}.png")
                if plot_graph(graph, path):
                    written.append(path)
        return written


def explain(
    model: nn.Module,
    *args: Any,
    loss_fn=None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ExplainReport:
    """Compile ``model`` on the example inputs and return a report of every graph; no training.

    ``model`` is a sharded module, ``torch.compile(model, backend="zero3", options=...)`` (whose
    options are reused unless ``options`` is given), or a function (compiled or not) that runs
    one. One forward runs, and a backward of ``loss_fn(output)`` (default: the sum of the
    floating-point outputs) when the output requires grad; the parameters' gradients are restored
    afterwards. Every rank must call it.

    A compiled module or function whose model no zero3 backend has compiled yet is compiled
    through its own backend (with ``options`` not given): the training that follows runs the
    graphs reported here and compiles nothing more for these input shapes (other shapes
    recompile, as they would after any first step). Otherwise the graphs are compiled afresh
    beside the model's own, which they leave alone.

    With ``gradient_quantization`` the step runs a second time (the same RNG state and buffers),
    compiled with exact reductions, and each quantized bucket reports its gradients' error
    against those (``ReduceInfo.quantization_error``); with ``weight_quantization`` each int8
    all-gather bucket reports its shards' round-trip error (``GatherInfo.quantization_error``).

    Example:
        ```python
        report = z3.explain(model, torch.randn(8, 64), options={"bucket_mb": 25})
        print(report)  # gathers, buckets, reduce-scatters, bytes, the memory timeline
        report.save("zero3_report")  # report.txt, report.json, pictures
        ```
    """
    from ...compiler.backend import zero3_backend

    base = uncompiled(model)
    if base is model:
        base = compiled_function_original(model) or model
    grads = {p: p.grad for p in _sharded_parameters_of(base)}
    if options is None and _zero3_wrapper(model) is not None and not _ever_compiled(list(grads)):
        # its own backend: the graphs compiled here are the ones the training runs next
        compiled = model
        options = _options_of(model)
    else:
        options = _options_of(model) if options is None else options
        # a new backend object: dynamo compiles fresh graphs instead of reusing the model's cache
        backend = functools.partial(zero3_backend, options=options)
        compiled = torch.compile(base, backend=backend)
    opts = Options.from_dict(options)
    exact = None
    try:
        rng = _rng_state()
        for param in grads:
            param.grad = None
        with record_graphs() as records:
            _step(compiled, loss_fn, args, kwargs)
        if opts.gradient_quantization is not None and records:
            quantized = {p: p.grad for p in grads}
            exact = _exact_gradients(base, opts, rng, list(grads), loss_fn, args, kwargs)
    finally:
        for param, grad in grads.items():
            param.grad = grad
    if not records:
        raise RuntimeError(
            "zero3: explain compiled no graph: dynamo ran the model without compiling it (it "
            "skips frames it failed on before, runs eagerly under an active TorchDispatchMode, "
            "and past torch._dynamo.config.recompile_limit); call explain outside such a mode, "
            "or torch._dynamo.reset() first"
        )
    report = ExplainReport([build_report(r) for r in records])
    _weight_quantization_errors(report, list(grads), options)
    if exact is not None:
        _gradient_quantization_errors(report, quantized, exact)
    return report


def _step(compiled, loss_fn, args, kwargs) -> None:
    output = compiled(*args, **kwargs)
    loss = loss_fn(output) if loss_fn is not None else _sum_floating(output)
    if loss is not None and loss.requires_grad:
        loss.backward()


def _exact_gradients(base, opts, rng, params: list, loss_fn, args, kwargs) -> dict:
    """The same step once more, its gradients reduced without compression (the RNG as the first
    run found it, the modules' buffers as the first run left them): what the quantized
    reduction's error is measured against."""
    from ...compiler.backend import zero3_backend

    modules = [m for m in (base,) if isinstance(m, nn.Module)]
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    exact = dataclasses.replace(opts, gradient_quantization=None, dump_dir=None)
    compiled = torch.compile(base, backend=functools.partial(zero3_backend, options=exact))
    for param in params:
        param.grad = None
    after = _rng_state()
    _set_rng_state(rng)
    try:
        _step(compiled, loss_fn, args, kwargs)
    finally:
        _set_rng_state(after)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return {p: p.grad for p in params}


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _gradient_quantization_errors(report: ExplainReport, quantized: dict, exact: dict) -> None:
    """Each quantized reduction bucket's error on this rank's reduced gradient shards."""
    from ...sharding.state import state_of

    by_name = {}
    for param in quantized:
        state = state_of(param)
        if state is not None and quantized[param] is not None and exact[param] is not None:
            by_name[state.fqn] = (_local(quantized[param]), _local(exact[param]))
    tiny = torch.finfo(torch.float32).tiny
    for graph in report.graphs:
        for reduction in graph.reductions:
            if reduction.full_bytes == reduction.bytes:
                continue
            pairs = [by_name.get(name) for name in reduction.params]
            if not pairs or any(p is None for p in pairs):
                continue
            got = torch.cat([q.float().reshape(-1) for q, _ in pairs])
            want = torch.cat([e.float().reshape(-1) for _, e in pairs])
            if want.numel() == 0:
                continue
            error = (got - want).abs()
            reduction.quantization_error = {
                "max_relative": float(error.max() / want.abs().max().clamp_min(tiny)),
                "mean_relative": float(error.mean() / want.abs().mean().clamp_min(tiny)),
            }


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, "to_local", None)
    return (to_local() if to_local is not None else grad).detach()


def _weight_quantization_errors(report: ExplainReport, params: list, options) -> None:
    """Each int8 all-gather bucket's error on this rank's shards: its part of what the first step
    sends, quantized and dequantized as the graph does (offloaded shards are not read)."""
    from ...collectives import arithmetic, quantize
    from ...compiler.options import Options
    from ...sharding.state import state_of

    opts = Options.from_dict(options)
    how = quantize.Quantization.of(opts.weight_quantization, opts.quantization_block)
    if how is None:
        return
    states = {s.fqn: s for s in (state_of(p) for p in params) if s is not None}
    for graph in report.graphs:
        for gather in graph.gathers:
            members = [states.get(name) for name in gather.params]
            if gather.full_bytes == gather.bytes or any(
                m is None or m.offload is not None for m in members
            ):
                continue
            specs = [m.spec for m in members]
            dtype = specs[0].gather_dtype(members[0].local().dtype)
            with torch.no_grad():
                flat = arithmetic.gather_input(
                    [m.local() for m in members], arithmetic.sizes(specs), dtype
                )
                sizes = arithmetic.sizes(specs)
                back = quantize.round_trip(flat.view(1, -1), sizes, how).view(-1)
                values = flat.float()
                error = (back - values).abs()
                tiny = torch.finfo(torch.float32).tiny
            gather.quantization_error = {
                "max_relative": float(error.max() / values.abs().max().clamp_min(tiny)),
                "mean_relative": float(error.mean() / values.abs().mean().clamp_min(tiny)),
            }


def _sharded_parameters_of(fn) -> list[torch.Tensor]:
    """The sharded parameters a module holds, or a function reaches (its bound object, closure
    and globals): the ones whose gradients ``explain`` must leave as it found them."""
    import inspect

    if isinstance(fn, nn.Module):
        roots = [fn]
    else:
        roots = []
        bound = getattr(fn, "__self__", None)
        if isinstance(bound, nn.Module):
            roots.append(bound)
        target = getattr(fn, "__func__", fn)
        try:
            names = inspect.getclosurevars(target)
            values = [*names.nonlocals.values(), *names.globals.values()]
        except TypeError:  # a builtin or a callable object without code
            values = list(vars(fn).values()) if hasattr(fn, "__dict__") else []
        roots.extend(v for v in values if isinstance(v, nn.Module))
    seen: dict[int, torch.Tensor] = {}
    for root in roots:
        for param in root.parameters():
            if is_sharded(param):
                seen.setdefault(id(param), param)
    return list(seen.values())


def _sum_floating(output) -> torch.Tensor | None:
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    floating = [t.float().sum() for t in tensors if t.is_floating_point() and t.requires_grad]
    return sum(floating) if floating else None


def _options_of(model) -> dict[str, Any] | None:
    """The ``options`` a ``torch.compile(..., backend="zero3", options=...)`` module or function
    was given."""
    kwargs = getattr(_zero3_wrapper(model), "kwargs", None)
    if isinstance(kwargs, dict) and "options" in kwargs:
        return dict(kwargs["options"])
    return None


def _zero3_wrapper(model):
    """The backend object of a module or function ``torch.compile(..., backend="zero3")`` made
    (dynamo wraps it a few times; the innermost wrapper names the backend and keeps the kwargs),
    or None."""
    import inspect

    callback = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    if callback is None and callable(model) and compiled_function_original(model) is not None:
        try:
            callback = inspect.getclosurevars(model).nonlocals.get("callback")
        except TypeError:
            callback = None
    for _ in range(8):
        if getattr(callback, "compiler_name", None) in ("zero3", "zero3_backend"):
            return callback
        callback = inner_backend(callback)
        if callback is None:
            return None
    return None


def _ever_compiled(params: list[torch.Tensor]) -> bool:
    """Whether a zero3 backend compiled a graph reading these parameters' models before (or they
    are none we know of): the compiled module's dynamo cache may then hold graphs for other
    inputs or options, and ``explain`` compiles its own to report all of them."""
    from ...sharding.state import state_of

    roots = [s.root for s in (state_of(p) for p in params) if s is not None]
    return not roots or any(root is None or root.graphs_compiled > 0 for root in roots)
