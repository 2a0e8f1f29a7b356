"""The package's layers import only the layers beneath them (read from the source, no imports run).

sharding -> offload -> runtime -> collectives -> compiler -> frontend -> io -> tools -> rollout
-> hf -> deepspeed -> parallel -> verl (the integrations; rollout sits below hf so that hf may
export merged weights with it): a module may import its own layer and those before it. So the
tools and the integrations are never imported by the core, and the compiler never imports the
frontend.
``compat.py`` (torch version differences) is beneath everything; the package's ``__init__`` and the
command-line aliases (``inspect/``, ``estimate/``) are the public face and may import anything.
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zero3_compile")
LAYERS = [
    "compat",
    "sharding",
    "offload",
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
    return dotted.split(".")[0]


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
    upward = sorted(
        target
        for target in _imported(parts, path)
        if _layer(target) in LAYERS and LAYERS.index(_layer(target)) > rank
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
    {"offload.in_backward", "offload.optimizer"},  # the optimizer offload becomes one component
    {"runtime.optimizers", "runtime.write_through"},
    {"rollout.adapters", "rollout.plan"},
    {"hf.peft", "hf.saving"},
    {"hf.trainer", "hf.trl"},
]


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
