"""The docs are tested: every Python snippet of README.md and docs/**/*.md runs, or says it does not.

The convention (docs/contributing.md): a ```python block with no marker runs as it is, in one
fresh process with no process group; one preceded by ``<!-- run: 2 ranks -->`` runs on 2 gloo
ranks (as under ``torchrun --nproc-per-node 2``: its ``dist.init_process_group()`` joins the
group the launcher made); one preceded by ``<!-- illustrative -->`` is not run (it needs GPUs,
nodes, a big model, or is a fragment). ``, setup: tiny-gpt2`` after the rank count writes a
small random GPT-2 folder named ``tiny-gpt2`` into the snippet's working folder first. Snippets
run with ``codegen="eager"`` unless they choose a codegen (Inductor's cold compiles take minutes
on 2 cores; the suite tests Inductor elsewhere). Also: every public name has a docstring with an
example and a place in the API reference, and the options table is generated, never written.
"""

from __future__ import annotations

import dataclasses
import glob
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from ..support.dist_utils import run_ranks
from ..support.paths import ROOT

MARKER = re.compile(r"^<!--\s*(.*?)\s*-->$")
RUN = re.compile(r"^run:\s*(\d+) ranks?(?:,\s*setup:\s*([\w-]+))?$")
PYTHON_FENCES = ("python", "py", "python3", "pycon")


@dataclasses.dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    ranks: int  # 0: illustrative (not run), 1: one process, N: N gloo ranks
    setup: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return files


def parse(path: str) -> list[Snippet]:
    """The ```python blocks of one Markdown file with their markers (fences may be indented)."""
    rel = os.path.relpath(path, ROOT)
    lines = open(path, encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if lang.lower() in PYTHON_FENCES:
            body = [
                line[len(indent) :] if line.startswith(indent) else line
                for line in lines[i + 1 : end]
            ]
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before)
            text = marker.group(1) if marker else None
            if text == "illustrative":
                ranks, setup = 0, None
            elif text is not None and RUN.match(text):
                ranks, setup = int(RUN.match(text).group(1)), RUN.match(text).group(2)
            elif text is not None and (text.startswith("run") or text.startswith("illustr")):
                raise ValueError(f"{rel}:{i + 1}: unknown snippet marker <!-- {text} -->")
            else:
                ranks, setup = 1, None
            out.append(Snippet(rel, i + 1, textwrap.dedent("\n".join(body)) + "\n", ranks, setup))
        i = end + 1
    return out


def all_snippets() -> list[Snippet]:
    return [s for path in doc_files() for s in parse(path)]


# ------------------------------------------------------------------------------- running them

_PRELUDE = """
import os, sys, json, traceback
import torch
_compile = torch.compile

def _eager_by_default(model=None, *args, backend="inductor", options=None, **kwargs):
    if backend == "zero3":
        options = {"codegen": "eager", **(options or {})}
    if model is None:
        return lambda m: _compile(m, *args, backend=backend, options=options, **kwargs)
    return _compile(model, *args, backend=backend, options=options, **kwargs)

torch.compile = _eager_by_default
"""


def _tiny_gpt2(folder: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)


def _run_on_ranks(
    rank: int, world: int, snippets: list[Snippet], workdir: str
) -> list[tuple[str, float]]:
    """Each snippet in turn on every rank, in a fresh namespace; the group is already up.
    Returns (where, this rank's CPU seconds) of each."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    exec(_PRELUDE, {})  # torch.compile(..., backend="zero3") defaults to eager codegen
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)
    dist.destroy_process_group = lambda *a, **k: None  # the launcher's group outlives a snippet
    done = []
    try:
        for index, snippet in enumerate(snippets):
            folder = os.path.join(workdir, f"snippet{index}")
            if rank == 0:
                os.makedirs(folder, exist_ok=True)
                if snippet.setup == "tiny-gpt2":
                    _tiny_gpt2(os.path.join(folder, "tiny-gpt2"))
            dist.barrier()
            os.chdir(folder)
            torch._dynamo.reset()
            torch.manual_seed(0)
            cpu = time.process_time()
            try:
                exec(compile(snippet.code, snippet.where, "exec"), {"__name__": "__main__"})
            except BaseException as error:
                raise RuntimeError(f"{snippet.where} failed on rank {rank}: {error!r}") from error
            done.append((snippet.where, time.process_time() - cpu))
            dist.barrier()
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    return done


_ONE_PROCESS = (
    _PRELUDE
    + """
snippets = json.load(sys.stdin)
for index, (where, code) in enumerate(snippets):
    folder = os.path.join(sys.argv[1], f"snippet{index}")
    os.makedirs(folder)
    os.chdir(folder)
    torch.manual_seed(0)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"SNIPPET FAILED: {where}\\n{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1)
    print(f"SNIPPET OK: {where}", flush=True)
"""
)


def test_every_python_snippet_is_run_or_marked_illustrative():
    """Markers parse, the files have snippets, and the README's two examples run on 2 ranks."""
    snippets = all_snippets()
    assert len(snippets) >= 20, [s.where for s in snippets]
    readme = [s for s in snippets if s.path == "README.md"]
    assert len(readme) >= 2 and all(s.ranks == 2 for s in readme[:2]), readme
    assert all(len(s.code.strip().splitlines()) <= 14 for s in readme[:2])  # "10-line" examples
    run = [s for s in snippets if s.ranks]
    assert len(run) >= len(snippets) / 2, "most snippets should run"


def test_single_process_snippets_run():
    snippets = _once([s for s in all_snippets() if s.ranks == 1])
    assert snippets
    with tempfile.TemporaryDirectory(prefix="z3-docs-") as workdir:
        done = subprocess.run(
            [sys.executable, "-c", _ONE_PROCESS, workdir],
            input=json.dumps([(s.where, s.code) for s in snippets]),
            capture_output=True,
            text=True,
            timeout=600,
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert done.stdout.count("SNIPPET OK") == len(snippets)


def _once(snippets: list[Snippet]) -> list[Snippet]:
    """One of each: a snippet shown twice (the README's, again in its guide) runs once."""
    seen, out = set(), []
    for snippet in snippets:
        if (snippet.code, snippet.ranks, snippet.setup) not in seen:
            seen.add((snippet.code, snippet.ranks, snippet.setup))
            out.append(snippet)
    return out


def test_multi_rank_snippets_run_on_gloo_ranks():
    snippets = _once([s for s in all_snippets() if s.ranks == 2])
    assert {s.ranks for s in all_snippets()} <= {0, 1, 2}, "only 1- and 2-rank snippets are run"
    with tempfile.TemporaryDirectory(prefix="z3-docs-") as workdir:
        done = run_ranks(_run_on_ranks, 2, snippets, workdir, timeout=900)
    print("CPU seconds per snippet, rank 0:", done[0])
    assert [w for w, _ in done[0]] == [w for w, _ in done[1]] == [s.where for s in snippets]


# ------------------------------------------------------------------------- generated reference


def _public_names() -> list[tuple[str, str, object]]:
    """(module, name, object) of every public name: the package, hf, parallel, deepspeed,
    rollout."""
    import importlib

    out = []
    for module_name in ("zero3_compile", "zero3_compile.hf", "zero3_compile.parallel",
                        "zero3_compile.deepspeed", "zero3_compile.rollout"):  # fmt: skip
        module = importlib.import_module(module_name)
        out += [(module_name, name, getattr(module, name)) for name in module.__all__]
    return out


def test_every_public_name_has_a_docstring_with_an_example_and_a_reference_entry():
    reference = ""
    for page in glob.glob(os.path.join(ROOT, "docs", "reference", "*.md")):
        with open(page) as f:
            reference += f.read()
    missing_doc, missing_ref = [], []
    for module, name, obj in _public_names():
        doc = inspect.getdoc(obj) or ""
        if "```" not in doc and ">>>" not in doc:  # an example: a code block or a doctest
            missing_doc.append(f"{module}.{name}")
        homes = {module, getattr(obj, "__module__", module)}
        if getattr(sys.modules["zero3_compile"], name, None) is obj:  # a re-export of z3's
            homes.add("zero3_compile")
        if not any(f"::: {home}.{name}\n" in reference for home in homes):
            missing_ref.append(f"{module}.{name}")
    assert not missing_doc, f"public names whose docstring has no example: {missing_doc}"
    assert not missing_ref, f"public names missing from docs/reference/*.md: {missing_ref}"


def test_the_options_table_is_generated_from_options_and_written_nowhere():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    import zero3_compile as z3

    table = hooks.options_table()
    for field in dataclasses.fields(z3.Options):
        assert f"| `{field.name}` | " in table
        assert f"`{field.default!r}`" in table
    assert "ZERO3_DUMP_DIR" in table  # the meaning comes from the docstring
    for path in doc_files():
        with open(path) as f:
            text = f.read()
        assert "| `bucket_mb` |" not in text, f"{path} writes an options table by hand"
    keys = hooks.deepspeed_keys_table()
    assert "reduce_bucket_size" in keys and "overlap_comm" in keys


@pytest.mark.parametrize("path", ["README.md"])
def test_readme_is_short_and_has_no_commit_hashes(path):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    assert len(text.splitlines()) <= 160
    assert not re.findall(r"\b[0-9a-f]{7,40}\b", text), "a commit hash in the README"
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q' in text  # CI's command
