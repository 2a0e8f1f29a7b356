"""The package's layers import only the layers beneath them (read from the source, no imports run).

cluster -> sharding -> offload -> offload.optim -> runtime -> collectives -> compiler -> frontend -> io -> tools -> rollout
-> hf -> deepspeed -> parallel -> verl (the integrations; rollout sits below hf so that hf may
export merged weights with it): a module may import its own layer and those before it. So the
tools and the integrations are never imported by the core, and the compiler never imports the
frontend. A sub-layer is named by its dotted path (``offload.optim``, the optimizer offload over
the offload foundation: the foundation never imports it); a package's ``__init__`` may re-export
what its package holds.
``_torch/`` (every private or version-dependent torch API) is beneath everything, and nothing
outside it names a private torch module or attribute; the package's ``__init__`` and the
command-line aliases (``inspect/``, ``estimate/``) are the public face and may import anything.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from ..support.paths import PACKAGE

LAYERS = [
    "_torch",
    "cluster",
    "sharding",
    "offload",
    "offload.optim",
    "runtime",
    "collectives",
    "compiler",
    "frontend",
    "io",
    "tools",
    "rollout",
    "hf",
    "deepspeed",
    "parallel",
    "verl",
]
PUBLIC_FACE = {"__init__", "inspect", "estimate"}


def _modules() -> list[tuple[str, list[str]]]:
    """(dotted module name relative to the package, its path parts) of every source file."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), PACKAGE)[: -len(".py")]
            parts = rel.split(os.sep)
            found.append((".".join(parts), parts))
    return sorted(found)


def _imported(parts: list[str], path: str) -> set[str]:
    """The package modules a file imports (any import statement, at any depth), as dotted names
    relative to the package."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
                if not node.module:  # from . import x
                    names.update(".".join(target + [alias.name]) for alias in node.names)
                    continue
                names.add(".".join(target))
            elif node.module and node.module.startswith("zero3_compile"):
                names.add(node.module.removeprefix("zero3_compile").lstrip("."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("zero3_compile."):
                    names.add(alias.name.removeprefix("zero3_compile."))
    return {n for n in names if n}


def _layer(dotted: str) -> str:
    """The longest entry of LAYERS that ``dotted`` is in (``offload.optim.tiles`` ->
    ``offload.optim``), else its first part."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return parts[0]


def test_every_module_belongs_to_a_layer():
    stray = [
        dotted
        for dotted, parts in _modules()
        if _layer(dotted) not in LAYERS and _layer(dotted) not in PUBLIC_FACE
    ]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


@pytest.mark.parametrize("dotted,parts", _modules(), ids=[m for m, _ in _modules()])
def test_imports_go_down_the_layers(dotted, parts):
    layer = _layer(dotted)
    if layer in PUBLIC_FACE:
        return
    path = os.path.join(PACKAGE, *parts) + ".py"
    rank = LAYERS.index(layer)
    own = ".".join(parts[:-1]) + "." if parts[-1] == "__init__" else None  # a package's face
    upward = sorted(
        target
        for target in _imported(parts, path)
        if _layer(target) in LAYERS
        and LAYERS.index(_layer(target)) > rank
        and not (own and target.startswith(own))
    )
    assert not upward, f"{dotted} (layer {layer}) imports from a layer above it: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """A lower layer importing a higher one is caught (relative and absolute spellings)."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from ..compiler.backend import zero3_backend\n"
        "def f():\n"
        "    from zero3_compile.tools.inspect import explain\n"
    )
    found = _imported(["sharding", "probe"], str(source))
    assert found == {"compiler.backend", "tools.inspect"}


def test_the_core_package_does_not_import_the_hugging_face_stack():
    import subprocess
    import sys

    code = (
        "import sys, zero3_compile; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'safetensors') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# Import cycles inside one subpackage known today (each a set of modules that import each other,
# at any depth); a cycle not listed fails. Remove an entry when its cycle is gone.
KNOWN_CYCLES = [
    {"runtime.optimizers", "runtime.write_through"},
    {"rollout.adapters", "rollout.plan"},
    {"hf.peft", "hf.saving"},
    {"hf.trainer", "hf.trl"},
]


# Layers whose modules import no private (underscore) name from another module.
PRIVATE_CHECKED = {"offload", "offload.optim"}


def test_no_private_name_is_imported_from_another_module():
    found = []
    for dotted, parts in _modules():
        if _layer(dotted) not in PRIVATE_CHECKED:
            continue
        with open(os.path.join(PACKAGE, *parts) + ".py") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("zero3_compile")
            ):
                found += [
                    f"{dotted}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert not found, f"private names imported across modules (make them public or move): {found}"


def test_no_new_import_cycle_inside_a_subpackage():
    modules = dict(_modules())
    graph = {}
    for dotted, parts in modules.items():
        imported = _imported(parts, os.path.join(PACKAGE, *parts) + ".py")
        graph[dotted] = {
            t for t in imported if t in modules and t != dotted and _layer(t) == _layer(dotted)
        }
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        reach[start] = seen
    cycles = {frozenset(m for m in reach[v] if v in reach[m]) for v in graph if v in reach[v]}
    new = sorted(sorted(c) for c in cycles if set(c) not in KNOWN_CYCLES)
    assert not new, (
        f"modules of one subpackage that import each other (make imports go one way): {new}"
    )


# ------------------------------------------------------------------ private torch names

# Private torch names that modules outside ``_torch/`` may still use, (module, name) -> why.
# Keep it short: a new private use belongs in ``_torch/`` with a probe in test_torch_probes.py.
PRIVATE_TORCH_ALLOWED: dict[tuple[str, str], str] = {}


def _is_private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def private_torch_names(path: str) -> set[str]:
    """The private torch names a file uses: ``import torch._x``, ``from torch._x import y``,
    ``from torch.x import _y``, and attribute chains on a name bound to torch (``torch._C.f``,
    ``dist.distributed_c10d._f``, ``DeviceMesh._concatenate``), as dotted paths. Attributes of
    values (``module._parameters``, ``dtensor._local_tensor``): ``private_torch_attributes``."""
    with open(path) as f:
        tree = ast.parse(f.read())
    bound: dict[str, str] = {}  # a local name -> the torch path it stands for
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    found.update(alias.name for s in alias.name.split(".") if _is_private(s))
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.update(full for s in full.split(".") if _is_private(s))
                bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in bound:
            full = ".".join([bound[node.id], *reversed(chain)])
            if any(_is_private(s) for s in full.split(".")):
                found.add(full)
    # only the longest chain of each use: torch._C._f, not also torch._C
    return {n for n in found if not any(o.startswith(n + ".") for o in found)}


def test_private_torch_names_stay_in_the_torch_layer():
    """Every private torch API is used in ``_torch/`` (one place to look when a torch release
    breaks one, each entry with its probe), none elsewhere unless allowed above."""
    stray = []
    for dotted, parts in _modules():
        if _layer(dotted) == "_torch":
            continue
        for name in sorted(private_torch_names(os.path.join(PACKAGE, *parts) + ".py")):
            if (dotted, name) not in PRIVATE_TORCH_ALLOWED:
                stray.append(f"{dotted}: {name}")
    assert not stray, f"private torch names outside zero3_compile/_torch/: {stray}"


def test_the_checker_sees_private_torch_names(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch._dynamo.eval_frame import OptimizedModule\n"
        "from torch.utils import _pytree\n"
        "from torch.distributed.device_mesh import DeviceMesh\n"
        "def f(m):\n"
        "    torch._C._set_grad_enabled(False)\n"
        "    dist.distributed_c10d._resolve_process_group('g')\n"
        "    DeviceMesh._concatenate([m])\n"
        "    return torch.ops.aten.add.Tensor, torch.Tensor.__new__, m._parameters\n"
    )
    assert private_torch_names(str(source)) == {
        "torch._dynamo.eval_frame.OptimizedModule",
        "torch.utils._pytree",
        "torch._C._set_grad_enabled",
        "torch.distributed.distributed_c10d._resolve_process_group",
        "torch.distributed.device_mesh.DeviceMesh._concatenate",
    }


# Private attributes of torch objects (DTensor, Tensor, nn.Module, OpOverload, fx.Graph, compiled
# wrappers, checkpoint readers, ...) -> what to use outside ``_torch/`` instead. None of them is
# an attribute of this package's own classes (an own attribute of one of these names would need
# an entry in PRIVATE_ATTRIBUTES_ALLOWED, or better another name).
PRIVATE_TORCH_ATTRIBUTES = {
    "_local_tensor": "_torch.dtensor.local_tensor",
    "_spec": "_torch.dtensor.spec_of",
    "_version": "_torch.tensors.version",
    "_make_wrapper_subclass": "_torch.tensors.make_wrapper_subclass",
    "_is_param": "isinstance(t, nn.Parameter)",
    "_schema": "_torch.fx.schema_of",
    "_target_to_str": "_torch.fx.node_name",
    "_parameters": "_torch.modules.own_parameters",
    "_buffers": "_torch.modules.own_buffers",
    "_modules": "_torch.modules.own_children",
    "_non_persistent_buffers_set": "_torch.modules.non_persistent_buffer_names",
    "_flat_weights_names": "_torch.modules.rnn_flat_weight_names",
    "_register_load_state_dict_pre_hook": "module.register_load_state_dict_pre_hook",
    "_orig_mod": "_torch.dynamo.uncompiled",
    "_compiled_call_impl": "_torch.dynamo.is_compiled_module",
    "_torchdynamo_orig_callable": "_torch.dynamo.compiled_function_original",
    "_torchdynamo_orig_backend": "_torch.dynamo.inner_backend",
    "_boxed_call": "_torch.aot_autograd.mark_boxed",
    "_allgather_base": "_torch.c10d.side_all_gather",
    "_get_metadata_path": "_torch.checkpoint.metadata_path",
    "_post_metadata_inference_cleanup": "an override allowed in PRIVATE_ATTRIBUTES_ALLOWED",
}

# (module, attribute) -> why that module may name a private torch attribute. Keep it short.
PRIVATE_ATTRIBUTES_ALLOWED: dict[tuple[str, str], str] = {
    ("parallel.pipelining", "_post_metadata_inference_cleanup"): (
        "zero3's PipelineStage overrides torch's PipelineStage hook (a method of the subclass "
        "cannot move into _torch/); test_torch_probes.py::test_pipelining_metadata_cleanup_hook "
        "checks torch's stage still has it"
    ),
}

_NAMED_IN_CODE = re.compile(r"\.(" + "|".join(PRIVATE_TORCH_ATTRIBUTES) + r")\b")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module and of its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def private_torch_attributes(path: str) -> set[str]:
    """The private torch attributes (PRIVATE_TORCH_ATTRIBUTES) a file names: ``x._name`` read,
    written or deleted, ``getattr``/``hasattr``/``setattr``/``delattr(x, "_name", ...)``, a method
    ``def _name`` (an override), and ``._name`` inside a string that is not a docstring (source a
    module compiles, such as frontend/classes.py's generated parameter getters)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    docstrings = _docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH_ATTRIBUTES:
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in PRIVATE_TORCH_ATTRIBUTES:
                found.add(node.name)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in PRIVATE_TORCH_ATTRIBUTES
        ):
            found.add(node.args[1].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                found.update(_NAMED_IN_CODE.findall(node.value))
    return found


def test_private_torch_attributes_stay_in_the_torch_layer():
    """No module outside ``_torch/`` reads or writes a private attribute of a torch object: each
    has a ``_torch`` accessor (its assumption in the docstring, a probe in test_torch_probes.py)
    or a public spelling, which the failure names."""
    stray = []
    for dotted, parts in _modules():
        if _layer(dotted) == "_torch":
            continue
        for name in sorted(private_torch_attributes(os.path.join(PACKAGE, *parts) + ".py")):
            if (dotted, name) not in PRIVATE_ATTRIBUTES_ALLOWED:
                stray.append(f"{dotted}: .{name} (use {PRIVATE_TORCH_ATTRIBUTES[name]})")
    assert not stray, f"private torch attributes outside zero3_compile/_torch/: {stray}"


def test_the_checker_sees_private_torch_attributes(tmp_path):
    """Reads, writes, getattr spellings, overrides and generated source are seen; this package's
    own underscore attributes and docstrings are not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "def f(m, dt, t):\n"
        '    """Reads dt._local_tensor (a docstring: not a use)."""\n'
        "    m._parameters['w'] = dt\n"
        "    base = getattr(m, '_orig_mod', m)\n"
        "    code = 'def get(self):\\n    return self._buffers[0]\\n'\n"
        "    return t._version, m._zero3, dt._values, base, code\n"
        "class Stage:\n"
        "    def _post_metadata_inference_cleanup(self):\n"
        "        pass\n"
    )
    assert private_torch_attributes(str(source)) == {
        "_parameters",
        "_orig_mod",
        "_buffers",
        "_version",
        "_post_metadata_inference_cleanup",
    }
