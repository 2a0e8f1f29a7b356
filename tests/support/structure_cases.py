"""Random model structures, forward programs and training setups for the structure fuzzer.

A ``Case`` is plain data: a module tree (Linear, LayerNorm, Embedding, a parameter-holding
``Scale``, activations; Sequential / ModuleList / ModuleDict / a ``Residual`` wrapper, nested;
a module registered under two names; tied parameters; frozen modules or parameters; branches the
forward never calls), a forward program over it (module calls, loops over lists and dicts, one
input through every member of a list summed or concatenated, calls under ``no_grad`` or
activation checkpointing, graph breaks, sums and products, concatenations, in-place ops, views,
parameters read directly, detaches), what the forward returns (a tensor, tuples, dicts, with
non-tensor parts), and how it trains (world size, zero3 options, optimizer, steps, micro-batches
with gradient sync off but the last, a batch size that changes, an inference forward after).

``cases()`` is the hypothesis strategy; ``draw_cases(n, seed)`` draws ``n`` deterministically.
``source(case)`` renders a case as a standalone Python module: it is what runs (``build``
executes it) and what a failure prints; ``batches(case)`` makes its data. Running a case on
every rank against single-process eager is ``structure_runner.py``'s; shrinking a failing one
``structure_shrink.py``'s.

Used by ``tests/distributed/test_structure_fuzz.py`` (a fixed-seed slice) and ``bench/fuzz_structures.py``
(the nightly size). The same hypothesis version draws the same cases from the same seed.
"""

from __future__ import annotations

import dataclasses
import json
import linecache
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

VOCAB = 5  # embedding rows: uneven chunks over 2 and 3 ranks
ROWS = 2  # rows per rank and micro-batch (3 in a ragged case's later steps)


@dataclass(frozen=True)
class Mod:
    """A node of the module tree. ``kind``: linear, merge (Linear(2D, D)), layernorm, scale,
    embedding, act, seq, list, dict, residual, or ref (the module at ``args[0]``, registered
    again here)."""

    kind: str
    args: tuple = ()
    children: tuple[tuple[str, Mod], ...] = ()


@dataclass(frozen=True)
class Step:
    """``h{i} = ...``: ``op`` with ``args`` (ints name earlier values, strings paths or kinds)."""

    op: str
    args: tuple


@dataclass(frozen=True)
class Case:
    width: int
    tree: tuple[tuple[str, Mod], ...]  # the root's children
    # (path, name, source path, source name): the source's Parameter set on path too
    ties: tuple[tuple[str, str, str, str], ...] = ()
    frozen: tuple[str, ...] = ()  # paths (a module or "path.param") set requires_grad=False
    program: tuple[Step, ...] = ()
    output: tuple = ("value", 0)  # structure over value indices (see _render_output)
    loss_values: tuple[int, ...] = ()  # output leaves (in order) the loss reads
    world: int = 2
    options: tuple[tuple[str, Any], ...] = (("codegen", "eager"),)
    optimizer: str = "sgd"
    steps: int = 2
    micro_batches: int = 1
    plain_accumulation: bool = False  # micro-batches without turning gradient sync off
    keep_gathered: bool = False
    ragged: bool = False  # later steps use another batch size (a dynamic-shape recompile)
    inference: bool = False  # after training, a forward under no_grad compared too
    seed: int = 0

    @property
    def codegen(self) -> str:
        return dict(self.options).get("codegen", "inductor")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Case:
        raw = json.loads(text)

        def mod(m) -> Mod:
            return Mod(m["kind"], tuple(m["args"]), tuple((k, mod(c)) for k, c in m["children"]))

        return Case(
            width=raw["width"],
            tree=tuple((k, mod(m)) for k, m in raw["tree"]),
            ties=tuple(tuple(t) for t in raw["ties"]),
            frozen=tuple(raw["frozen"]),
            program=tuple(Step(s["op"], tuple(s["args"])) for s in raw["program"]),
            output=_tuples(raw["output"]),
            loss_values=tuple(raw["loss_values"]),
            world=raw["world"],
            options=tuple(tuple(o) for o in raw["options"]),
            optimizer=raw["optimizer"],
            steps=raw["steps"],
            micro_batches=raw["micro_batches"],
            plain_accumulation=raw.get("plain_accumulation", False),
            keep_gathered=raw["keep_gathered"],
            ragged=raw["ragged"],
            inference=raw.get("inference", False),
            seed=raw["seed"],
        )


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# ----------------------------------------------------------------------------- the tree

_PREAMBLE = '''import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

D = {width}
VOCAB = {vocab}


class Scale(nn.Module):
    """A parameter of its own (not an nn.Linear's) and a buffer."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, d))

    def forward(self, x):
        return x * self.weight + self.shift


class Residual(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)
'''

_ACTS = {"tanh": "nn.Tanh()", "relu": "nn.ReLU()", "gelu": "nn.GELU()", "sigmoid": "nn.Sigmoid()"}


def _expr(mod: Mod) -> str:
    """The constructor expression of a module."""
    kind, args = mod.kind, mod.args
    if kind == "linear":
        return "nn.Linear(D, D)" if args[0] else "nn.Linear(D, D, bias=False)"
    if kind == "merge":
        return "nn.Linear(2 * D, D)"
    if kind == "layernorm":
        return "nn.LayerNorm(D)" if args[0] else "nn.LayerNorm(D, elementwise_affine=False)"
    if kind == "scale":
        return "Scale(D)"
    if kind == "embedding":
        return "nn.Embedding(VOCAB, D)"
    if kind == "act":
        return _ACTS[args[0]]
    if kind == "ref":
        return args[0]
    inner = [_expr(c) for _, c in mod.children]
    if kind == "seq":
        return f"nn.Sequential({', '.join(inner)})"
    if kind == "list":
        return f"nn.ModuleList([{', '.join(inner)}])"
    if kind == "dict":
        items = ", ".join(f"{k!r}: {e}" for (k, _), e in zip(mod.children, inner))
        return f"nn.ModuleDict({{{items}}})"
    if kind == "residual":
        return f"Residual({inner[0]})"
    raise ValueError(kind)


def _child_path(parent: str, kind: str, key: str) -> str:
    if kind == "residual":
        return f"{parent}.inner"
    if kind == "dict":
        return f"{parent}[{key!r}]"
    return f"{parent}[{key}]"


def walk(tree: tuple[tuple[str, Mod], ...]) -> Iterator[tuple[str, Mod]]:
    """Every (path, node) of the tree, parents first; a ref's target is not walked again."""

    def visit(path: str, mod: Mod):
        yield path, mod
        for key, child in mod.children:
            yield from visit(_child_path(path, mod.kind, key), child)

    for name, mod in tree:
        yield from visit(f"self.{name}", mod)


def resolve(tree, path: str) -> Mod:
    """The node at ``path``, following refs."""
    nodes = dict(walk(tree))
    mod = nodes[path]
    while mod.kind == "ref":
        mod = nodes[mod.args[0]]
    return mod


_MAPS = {"linear", "layernorm", "scale", "act", "seq", "residual"}  # (B, D) -> (B, D)
_FRESH = {"linear", "layernorm", "scale"}  # outputs no backward reads: safe to write in place


def _param_slots(mod: Mod) -> list[tuple[str, str]]:
    """(param name, shape class) of a leaf's own parameters."""
    kind, args = mod.kind, mod.args
    if kind == "linear":
        return [("weight", "mat")] + ([("bias", "vec")] if args[0] else [])
    if kind == "merge":
        return [("weight", "wide"), ("bias", "vec")]
    if kind == "layernorm":
        return [("weight", "vec"), ("bias", "vec")] if args[0] else []
    if kind == "scale":
        return [("weight", "vec")]
    if kind == "embedding":
        return [("weight", "emb")]
    return []


def init_source(case: Case) -> str:
    lines = [
        "class Model(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
    ]
    for name, mod in case.tree:
        lines.append(f"        self.{name} = {_expr(mod)}")
    for path, param, source, source_param in case.ties:
        lines.append(f"        {path}.{param} = {source}.{source_param}  # tied")
    for path in case.frozen:
        lines.append(f"        {path}.requires_grad_(False)  # frozen")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the program


# the arguments of each op that name earlier values (the others are paths, kinds or counts)
VALUE_ARGS = {
    "call": (1,),
    "no_grad": (1,),
    "checkpoint": (1,),
    "loop": (1,),
    "branches": (1,),
    "embed": (),
    "binary": (1, 2),
    "merge": (1, 2),
    "stack": (0, 1),
    "cat_view": (0, 1),
    "act": (1,),
    "inplace": (1, 2),
    "view": (1,),
    "param": (3,),
    "detach": (0,),
    "graph_break": (0,),
}


def _render_step(i: int, step: Step) -> list[str]:
    h = f"h{i}"
    a = step.args
    v = lambda j: f"h{j}"  # noqa: E731
    op = step.op
    if op == "call":
        path, src, post = a
        lines = [f"{h} = {path}({v(src)})"]
        if post == "mul_":
            lines.append(f"{h}.mul_(0.5)")
        elif post == "add_":
            lines.append(f"{h}.add_(1.0)")
        return lines
    if op == "checkpoint":
        return [f"{h} = checkpoint({a[0]}, {v(a[1])}, use_reentrant=False)"]
    if op == "graph_break":
        return ["torch._dynamo.graph_break()", f"{h} = {v(a[0])}"]
    if op == "no_grad":
        return ["with torch.no_grad():", f"    {h} = {a[0]}({v(a[1])})"]
    if op == "branches":
        path, src, combine, count = a
        layers = f"{path}.values()" if combine.endswith("values") else path
        if combine.startswith("sum"):
            return [f"{h} = sum(layer({v(src)}) for layer in {layers})"]
        return [
            f"{h} = torch.cat([layer({v(src)}) for layer in {layers}], dim=-1)",
            f"{h} = {h}.view(-1, {count}, D).sum(dim=1)",
        ]
    if op == "loop":
        path, src, style = a
        if style == "items":
            return [
                f"{h} = {v(src)}",
                f"for _key, layer in {path}.items():",
                f"    {h} = layer({h})",
            ]
        return [f"{h} = {v(src)}", f"for layer in {path}:", f"    {h} = layer({h})"]
    if op == "embed":
        return [f"{h} = {a[0]}(ids)"]
    if op == "binary":
        return [f"{h} = {v(a[1])} {a[0]} {v(a[2])}"]
    if op == "merge":
        return [f"{h} = {a[0]}(torch.cat([{v(a[1])}, {v(a[2])}], dim=-1))"]
    if op == "stack":
        return [f"{h} = torch.stack([{v(a[0])}, {v(a[1])}], dim=1).mean(dim=1)"]
    if op == "cat_view":
        return [f"{h} = torch.cat([{v(a[0])}, {v(a[1])}], dim=-1).view(-1, 2, D).sum(dim=1)"]
    if op == "act":
        fn = {"tanh": "torch.tanh", "relu": "F.relu", "gelu": "F.gelu", "sigmoid": "torch.sigmoid"}
        return [f"{h} = {fn[a[0]]}({v(a[1])})"]
    if op == "inplace":
        kind, src, other = a
        lines = [f"{h} = {v(src)}.clone()"]
        if kind == "slice_mul":
            lines.append(f"{h}[:, ::2].mul_(2.0)")
        elif kind == "add_other":
            lines.append(f"{h}.add_({v(other)})")
        elif kind == "relu_":
            lines.append(f"{h}.relu_()")
        elif kind == "setitem":
            lines.append(f"{h}[:, 0] = {v(other)}[:, 1]")
        return lines
    if op == "view":
        kind, src = a
        x = v(src)
        exprs = {
            "transpose": f"{x}.view(-1, 2, D // 2).transpose(1, 2).reshape(-1, D)",
            "unsqueeze": f"{x}.unsqueeze(1).squeeze(1)",
            "chunk_swap": f"torch.cat({x}.chunk(2, dim=-1)[::-1], dim=-1)",
            "expand": f"{x}[:, :1].expand(-1, D) + {x}",
            "t": f"{x}.t().contiguous().t()",
        }
        return [f"{h} = {exprs[kind]}"]
    if op == "param":
        path, param, how, src = a
        if how == "linear":
            return [f"{h} = F.linear({v(src)}, {path}.{param})"]
        return [f"{h} = {v(src)} {how} {path}.{param}"]
    if op == "detach":
        return [f"{h} = {v(a[0])}.detach()"]
    raise ValueError(op)


def _render_output(output: tuple) -> str:
    kind = output[0]
    if kind == "value":
        return f"h{output[1]}"
    if kind == "const":
        return repr(output[1])
    inner = [_render_output(o) for o in output[1:]]
    if kind == "tuple":
        return "(" + ", ".join(inner) + ("," if len(inner) == 1 else "") + ")"
    if kind == "list":
        return "[" + ", ".join(inner) + "]"
    if kind == "dict":
        keys = ("out", "aux", "extra", "n", "tag")
        return "{" + ", ".join(f"{keys[i]!r}: {e}" for i, e in enumerate(inner)) + "}"
    raise ValueError(kind)


def _leaf_accessors(output: tuple, prefix: str = "out") -> list[tuple[str, int]]:
    """(how the loss reads it, value index) of each tensor leaf of the output, in order."""
    kind = output[0]
    if kind == "value":
        return [(prefix, output[1])]
    if kind == "const":
        return []
    keys = ("out", "aux", "extra", "n", "tag")
    found = []
    for i, sub in enumerate(output[1:]):
        key = repr(keys[i]) if kind == "dict" else str(i)
        found += _leaf_accessors(sub, f"{prefix}[{key}]")
    return found


def source(case: Case) -> str:
    """The case as a standalone Python module: ``Model``, ``loss_fn`` and how it trains."""
    body = []
    for i, step in enumerate(case.program, start=1):
        body += _render_step(i, step)
    forward = [
        "",
        "    def forward(self, x, ids):",
        "        h0 = x",
        *[f"        {line}" for line in body],
        f"        return {_render_output(case.output)}",
    ]
    leaves = dict(_leaf_accessors(case.output))
    by_value = {index: access for access, index in leaves.items()}
    terms = []
    for k, index in enumerate(case.loss_values):
        access = by_value[index]
        terms.append(
            f"({access} - y).square().mean()" if k == 0 else f"0.5 * {access}.square().mean()"
        )
    training = {
        "world": case.world,
        "options": dict(case.options),
        "optimizer": case.optimizer,
        "steps": case.steps,
        "micro_batches": case.micro_batches,
        "plain_accumulation": case.plain_accumulation,
        "keep_gathered": case.keep_gathered,
        "ragged": case.ragged,
        "inference": case.inference,
        "seed": case.seed,
    }
    return "\n".join(
        [
            _PREAMBLE.format(width=case.width, vocab=VOCAB),
            "",
            init_source(case),
            *forward,
            "",
            "",
            "def loss_fn(out, y):",
            f"    return {' + '.join(terms)}",
            "",
            "",
            f"TRAINING = {training!r}",
            "",
        ]
    )


_builds = 0


def build(case: Case) -> dict[str, Any]:
    """Execute ``source(case)``; returns its namespace (``Model``, ``loss_fn``)."""
    global _builds
    _builds += 1
    text = source(case)
    filename = f"<structure case {_builds}>"
    # the source shows in tracebacks and in dynamo's stack traces
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"structure_case_{_builds}"}
    exec(compile(text, filename, "exec"), namespace)
    return namespace


# ----------------------------------------------------------------------------- strategies

_OPTION_DRAWS = {
    "bucket_mb": (0.00005, 0.0005, 0.002),  # about one parameter, a few, most per bucket
    "prefetch_depth": (0, 2, 3),
    "reduce_scatter_depth": (2,),
    "max_inflight_bytes": (64,),
    "memory_budget_mb": (0.02, 1000.0),  # 20 KiB: keeps some gathered (small models); all
    "reshard_after_forward": (False,),
    "fused_copies": (True,),
}


# Probabilities are drawn as "a middle value of a small range" (``integers(0, 3) == 1``):
# hypothesis favours the ends of a range, which would switch most features on or off together.


@st.composite
def _module(draw, depth: int, refs: list[str], callable_only: bool = False) -> Mod:
    """A module; ``callable_only``: one that maps (B, D) to (B, D) (a Sequential's member)."""
    kinds = ["linear", "linear", "layernorm", "scale", "act"]
    if depth > 0:
        kinds += ["seq", "residual"] if callable_only else ["seq", "list", "dict", "residual"]
    if depth == 2:
        kinds += ["list", "list"]  # at the root: models keep their blocks in ModuleLists
    if refs:
        kinds.append("ref")
    kind = draw(st.sampled_from(kinds))
    if kind == "linear":
        return Mod("linear", (draw(st.booleans()),))
    if kind == "layernorm":
        return Mod("layernorm", (draw(st.booleans()),))
    if kind == "scale":
        return Mod("scale")
    if kind == "act":
        return Mod("act", (draw(st.sampled_from(sorted(_ACTS))),))
    if kind == "ref":
        return Mod("ref", (draw(st.sampled_from(refs)),))
    count = 1 if kind == "residual" else draw(st.integers(1 if kind == "seq" else 2, 3))
    # a ModuleList of alike blocks, as models have them (layers, heads, experts)
    alike = kind == "list" and draw(st.booleans())
    children: list[tuple[str, Mod]] = []
    for i in range(count):
        key = "inner" if kind == "residual" else ("abc"[i] if kind == "dict" else str(i))
        if alike and children:
            children.append((key, children[0][1]))
            continue
        # a list's or dict's members are mostly callable: a loop or parallel branches over them
        inner_callable = kind in ("seq", "residual") or draw(st.integers(0, 3)) != 1
        children.append((key, draw(_module(depth - 1, refs, inner_callable))))
    return Mod(kind, (), tuple(children))


def _map_kind(tree, path: str) -> str:
    return resolve(tree, path).kind


@st.composite
def _tree(draw) -> tuple[tuple[str, Mod], ...]:
    tree: list[tuple[str, Mod]] = []
    for i in range(draw(st.integers(1, 4))):
        # a ref names a map module of an earlier root child (registered twice)
        refs = [p for p, m in walk(tuple(tree)) if m.kind in _MAPS]
        tree.append((f"m{i}", draw(_module(2, refs))))
    if draw(st.integers(0, 3)) == 1:
        tree.append(("merge", Mod("merge")))
    if draw(st.integers(0, 3)) == 1:
        tree.append(("emb", Mod("embedding")))
    tree.append(("head", Mod("linear", (True,))))  # called only when nothing else is trainable
    return tuple(tree)


def _slots(tree) -> list[tuple[str, str, str]]:
    """(path, param name, shape class) of every parameter slot of a non-ref leaf."""
    return [
        (path, name, shape)
        for path, mod in walk(tree)
        if mod.kind != "ref"
        for name, shape in _param_slots(mod)
    ]


@st.composite
def _ties_and_frozen(draw, tree):
    slots = [s for s in _slots(tree) if not s[0].startswith("self.head")]
    ties = []
    if len(slots) >= 2 and draw(st.integers(0, 2)) == 1:
        dst = draw(st.sampled_from(slots))
        same = [s for s in slots if s[2] == dst[2] and s[0] != dst[0] and s[2] in ("mat", "vec")]
        if same:
            src = draw(st.sampled_from(same))
            ties.append((dst[0], dst[1], src[0], src[1]))
    frozen = []
    if draw(st.integers(0, 2)) == 1:
        modules = [p for p, m in walk(tree) if m.kind != "ref" and not p.startswith("self.head")]
        choices = modules + [f"{p}.{n}" for p, n, _ in slots]
        for _ in range(draw(st.integers(1, 2))):
            frozen.append(draw(st.sampled_from(choices)))
    return tuple(ties), tuple(dict.fromkeys(frozen))


class _Inventory:
    """What the program can use, from an instance of the case's ``Model``."""

    def __init__(self, case: Case):
        model = build(replace(case, program=(), output=("value", 0), loss_values=(0,)))["Model"]()
        self.model = model
        nodes = list(walk(case.tree))
        self.maps = [p for p, _ in nodes if _map_kind(case.tree, p) in _MAPS and "head" not in p]
        self.fresh = [p for p in self.maps if _map_kind(case.tree, p) in _FRESH]
        self.loops = [
            p
            for p, _ in nodes
            if _map_kind(case.tree, p) in ("list", "dict")
            and all(c.kind in _MAPS or c.kind == "ref" for _, c in resolve(case.tree, p).children)
        ]
        self.merges = [p for p, _ in nodes if _map_kind(case.tree, p) == "merge"]
        self.embeds = [p for p, _ in nodes if _map_kind(case.tree, p) == "embedding"]
        self.params = []  # (path, param name, shape class) readable directly
        for path, _ in nodes:
            for name, shape in _param_slots(resolve(case.tree, path)):
                if shape in ("mat", "vec") and "head" not in path:
                    self.params.append((path, name, shape))

    def trainable(self, path: str) -> bool:
        target = eval(path, {"self": self.model})  # noqa: S307 (our own generated paths)
        if isinstance(target, torch.nn.Parameter):
            return target.requires_grad
        return any(p.requires_grad for p in target.parameters())


@st.composite
def _program(draw, case: Case):
    inv = _Inventory(case)
    grads = [False]  # h0 = x
    steps: list[Step] = []
    ops = ["call", "call", "call", "binary", "act", "inplace", "view", "stack", "cat_view"]
    ops += ["no_grad", "detach", "checkpoint", "graph_break"]
    if inv.loops:
        ops += ["loop", "loop", "branches", "branches"]
    if inv.merges:
        ops.append("merge")
    if inv.embeds:
        ops.append("embed")
    if inv.params:
        ops += ["param", "param"]
    if not inv.maps:
        ops = [o for o in ops if o not in ("call", "no_grad", "checkpoint")]
    value = st.integers(0, 0)
    for _ in range(draw(st.integers(2, 8))):
        value = st.integers(0, len(grads) - 1)
        op = draw(st.sampled_from(ops))
        if op == "call":
            path = draw(st.sampled_from(inv.maps))
            src = draw(value)
            post = (
                draw(st.sampled_from([None, None, "mul_", "add_"])) if path in inv.fresh else None
            )
            step, grad = Step(op, (path, src, post)), inv.trainable(path) or grads[src]
        elif op == "checkpoint":
            path, src = draw(st.sampled_from(inv.maps)), draw(value)
            step, grad = Step(op, (path, src)), inv.trainable(path) or grads[src]
        elif op == "graph_break":
            src = draw(value)
            step, grad = Step(op, (src,)), grads[src]
        elif op == "no_grad":
            step, grad = Step(op, (draw(st.sampled_from(inv.maps)), draw(value))), False
        elif op == "loop":
            path, src = draw(st.sampled_from(inv.loops)), draw(value)
            style = "items" if _map_kind(case.tree, path) == "dict" else "iter"
            step, grad = Step(op, (path, src, style)), inv.trainable(path) or grads[src]
        elif op == "branches":  # the same input through every member, summed or concatenated
            path, src = draw(st.sampled_from(inv.loops)), draw(value)
            combine = draw(st.sampled_from(["sum", "cat"]))
            if _map_kind(case.tree, path) == "dict":
                combine += "_values"
            count = len(resolve(case.tree, path).children)
            step = Step(op, (path, src, combine, count))
            grad = inv.trainable(path) or grads[src]
        elif op == "embed":
            path = draw(st.sampled_from(inv.embeds))
            step, grad = Step(op, (path,)), inv.trainable(path)
        elif op in ("binary", "merge", "stack", "cat_view"):
            a, b = draw(value), draw(value)
            grad = grads[a] or grads[b]
            if op == "binary":
                step = Step(op, (draw(st.sampled_from(["+", "-", "*"])), a, b))
            elif op == "merge":
                path = draw(st.sampled_from(inv.merges))
                step, grad = Step(op, (path, a, b)), grad or inv.trainable(path)
            else:
                step = Step(op, (a, b))
        elif op == "act":
            src = draw(value)
            step, grad = Step(op, (draw(st.sampled_from(sorted(_ACTS))), src)), grads[src]
        elif op == "inplace":
            kind = draw(st.sampled_from(["slice_mul", "add_other", "relu_", "setitem"]))
            src, other = draw(value), draw(value)
            uses_other = kind in ("add_other", "setitem")
            step = Step(op, (kind, src, other if uses_other else None))
            grad = grads[src] or (uses_other and grads[other])
        elif op == "view":
            kind = draw(st.sampled_from(["transpose", "unsqueeze", "chunk_swap", "expand", "t"]))
            src = draw(value)
            step, grad = Step(op, (kind, src)), grads[src]
        elif op == "param":
            path, name, shape = draw(st.sampled_from(inv.params))
            how = "linear" if shape == "mat" else draw(st.sampled_from(["*", "+"]))
            src = draw(value)
            step = Step(op, (path, name, how, src))
            grad = grads[src] or inv.trainable(f"{path}.{name}")
        else:  # detach
            step, grad = Step(op, (draw(value),)), False
        steps.append(step)
        grads.append(bool(grad))
    last = len(grads) - 1
    if not grads[last] and draw(st.booleans()):
        candidates = [i for i, g in enumerate(grads) if g]
        if candidates:
            last = candidates[-1]
    if not grads[last]:  # nothing the loss could differentiate: the head makes it trainable
        steps.append(Step("call", ("self.head", last, None)))
        grads.append(True)
        last = len(grads) - 1
    return tuple(steps), last, grads


@st.composite
def _output(draw, main: int, count: int):
    """The output structure around value ``main`` (always read by the loss), with 0-2 others."""
    others = [draw(st.integers(0, count - 1)) for _ in range(draw(st.integers(0, 2)))]
    kind = draw(st.sampled_from(["tensor", "tensor", "tuple", "tuple_const", "dict", "nested"]))
    values = [("value", main)] + [("value", o) for o in others]
    if kind == "tensor" or (kind == "tuple" and not others):
        structure = values[0]
    elif kind == "tuple":
        structure = ("tuple", *values)
    elif kind == "tuple_const":
        structure = ("tuple", values[0], ("const", None), ("const", 3), *values[1:])
    elif kind == "dict":
        structure = ("dict", *values, ("const", 2))
    else:
        structure = ("tuple", values[0], ("dict", ("list", *values[1:]), ("const", "fuzz")))
    leaves = [index for _, index in _leaf_accessors(structure)]
    extra = [o for o in dict.fromkeys(leaves) if o != main and draw(st.booleans())]
    return structure, (main, *extra)


@st.composite
def cases(
    draw,
    worlds: tuple[int, ...] = (1, 2, 3),
    codegens: tuple[str, ...] = ("eager",),
    excluded: frozenset[str] = frozenset(),
):
    """A random ``Case``. ``excluded``: option or feature names never drawn (see
    ``EXCLUDED``)."""
    width = draw(st.sampled_from([4, 6]))
    tree = draw(_tree())
    ties, frozen = draw(_ties_and_frozen(tree))
    case = Case(width=width, tree=tree, ties=ties, frozen=frozen)
    program, main, grads = draw(_program(case))
    output, loss_values = draw(_output(main, len(grads)))
    options: list[tuple[str, Any]] = [("codegen", draw(st.sampled_from(codegens)))]
    for name, values in _OPTION_DRAWS.items():
        if name not in excluded and draw(st.integers(0, 3)) == 1:
            options.append((name, draw(st.sampled_from(values))))
    micro_batches = 1
    if "accumulation" not in excluded:
        micro_batches = draw(st.sampled_from([1, 1, 2, 3]))
    plain = micro_batches > 1 and draw(st.integers(0, 2)) == 1
    keep = not plain and micro_batches > 1 and "keep_gathered" not in excluded
    keep = keep and draw(st.booleans())
    return replace(
        case,
        program=program,
        output=output,
        loss_values=loss_values,
        world=draw(st.sampled_from(worlds)),
        options=tuple(options),
        optimizer=draw(st.sampled_from(["sgd", "adamw"])),
        steps=draw(st.sampled_from([2, 2, 3])),
        micro_batches=micro_batches,
        plain_accumulation=plain,
        keep_gathered=keep,
        ragged="ragged" not in excluded and draw(st.integers(0, 6)) == 3,
        inference="inference" not in excluded and draw(st.integers(0, 3)) == 1,
        seed=draw(st.integers(0, 2**16)),
    )


# Features kept out of the draw until the area's owner fixes them (each names its note in
# /work/coord/NOTES.md). None at present (keep_gathered came back once the gradient gate covered
# kept parameters: an output the loss ignores left them a zero .grad where eager has None).
EXCLUDED: frozenset[str] = frozenset()


def draw_cases(
    count: int,
    seed: int,
    worlds: tuple[int, ...] = (1, 2, 3),
    inductor: int = 0,
    excluded: frozenset[str] = EXCLUDED,
    spread: int = 1,
) -> list[Case]:
    """``count`` distinct cases drawn by hypothesis from ``seed`` (the same list every time):
    world sizes in turn from ``worlds``, ``inductor`` of them (chosen by the seed) compiled with
    Inductor, the others with the eager codegen (its compiles take seconds, not tens).
    ``spread``: draw ``count * spread`` and keep every ``spread``-th (hypothesis starts with
    its simplest examples; a short list spread over a longer draw holds richer ones)."""
    found: dict[str, Case] = {}
    wanted = count * spread

    @settings(
        max_examples=wanted * 2,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(worlds=worlds[:1], excluded=excluded))
    def collect(case: Case) -> None:
        if len(found) < wanted:
            found.setdefault(case.to_json(), case)

    hypothesis_seed(seed)(collect)()
    kept = list(found.values())[spread - 1 :: spread]
    chosen = set(random.Random(seed).sample(range(len(kept)), min(inductor, len(kept))))
    drawn = []
    for i, case in enumerate(kept):
        options = dict(case.options, codegen="inductor" if i in chosen else "eager")
        drawn.append(replace(case, world=worlds[i % len(worlds)], options=tuple(options.items())))
    return drawn


def batches(case: Case) -> Callable:
    """``batch(step, micro, rank) -> ((x, ids), y)``: each rank's share of a micro-batch."""

    def batch(step: int, micro: int, rank: int):
        rows = ROWS + 1 if case.ragged and step > 0 else ROWS
        g = torch.Generator().manual_seed(case.seed * 7919 + 1000 * step + 10 * micro + rank)
        x = torch.randn(rows, case.width, generator=g)
        ids = torch.randint(0, VOCAB, (rows,), generator=g)
        return (x, ids), torch.randn(rows, case.width, generator=g)

    return batch
