"""The examples in examples/ run from a clone on their own, and each one is run by a test.

Here, in one launch of 2 gloo ranks with tiny settings: ``demo.py`` (its printed lines, the ones
docs/getting-started.md explains), ``hf_trainer.py`` (a tiny GPT-2 trained, saved, loaded back by
plain transformers) and ``parallel_3d.py`` on too few ranks (a clear message before any process
group starts). ``train.py`` is run by tests/distributed/test_faults.py (killed and resumed under torchrun),
``accelerate_loop.py`` by tests/distributed/test_hf.py (under ``accelerate launch``) and ``parallel_3d.py``
on 8 ranks by tests/distributed/test_pipelining.py; other examples by the tests of their own features.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import os
import runpy
import sys
import tempfile
import time

from ..support.dist_utils import run_ranks
from ..support.paths import ROOT

EXAMPLES = os.path.join(ROOT, "examples")
HELPERS = {"gpt_model.py"}  # modules the examples import, not scripts


def _scripts() -> list[str]:
    return sorted(
        os.path.basename(p)
        for p in glob.glob(os.path.join(EXAMPLES, "*.py"))
        if os.path.basename(p) not in HELPERS
    )


def test_no_example_imports_the_tests():
    for path in glob.glob(os.path.join(EXAMPLES, "*.py")):
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "tests" or n.startswith("tests.") for n in names), (path, names)


def test_every_example_is_run_by_a_test():
    tests = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        if os.path.basename(path) != "test_examples.py":  # its docstring names the others
            tests[os.path.basename(path)] = open(path).read()
    here = {"demo.py", "hf_trainer.py", "parallel_3d.py"}
    unrun = [
        name
        for name in _scripts()
        if name not in here
        and not any(f'"{name}"' in text or f"/{name}" in text for text in tests.values())
    ]
    assert not unrun, f"examples no test runs: {unrun}"


def _run_examples(rank: int, world: int, workdir: str) -> dict[str, object]:
    """Each example as ``python examples/X.py ...`` would run it, in this rank's process."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    init, destroy = dist.init_process_group, dist.destroy_process_group
    started = []

    def joined(*args, **kwargs):  # torchrun's group is the launcher's, already made
        started.append(args)
        return None if dist.is_initialized() else init(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = joined, lambda *a, **k: None
    out: dict[str, object] = {}

    def run(script: str, *argv: str) -> tuple[str, str, object]:
        torch._dynamo.reset()
        cpu = time.process_time()
        stdout, stderr = io.StringIO(), io.StringIO()
        sys.argv, code = [script, *argv], 0
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
        out.setdefault("cpu_s", {})[script] = time.process_time() - cpu
        dist.barrier()
        return stdout.getvalue(), stderr.getvalue(), code

    try:
        os.chdir(workdir)
        started.clear()
        _, err, code = run("parallel_3d.py")
        out["parallel_3d"] = (err, code, len(started))
        out["demo"] = run("demo.py", "--codegen", "eager", "--steps", "2", "--layers", "1")[0]
        hf_args = ["--codegen", "eager", "--steps", "2", "--seq", "16", "--layers", "1"]
        trained = run("hf_trainer.py", *hf_args, "--out", os.path.join(workdir, "hf"))
        out["hf_trainer"] = trained[0]
        if rank == 0:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(workdir, "hf", "final")
            )
            out["hf_params"] = sum(p.numel() for p in model.parameters())
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    return out


def test_examples_run_with_tiny_settings():
    with tempfile.TemporaryDirectory(prefix="z3-examples-") as workdir:
        ranks = run_ranks(_run_examples, 2, workdir, timeout=900)
    print("CPU seconds per example and rank:", [r["cpu_s"] for r in ranks])
    # parallel_3d.py needs pipeline 2 x tensor 2 ranks: on 2 it says so and exits before any group
    err, code, started = ranks[0]["parallel_3d"]
    assert code == 2 and started == 0, (code, started)
    assert "needs a multiple of 4 ranks" in err and "--nproc-per-node 4" in err, err
    assert ranks[1]["parallel_3d"][0] == ""  # said once, by rank 0
    # demo.py: the lines docs/getting-started.md explains
    demo = ranks[0]["demo"]
    assert "step 1: loss" in demo and "(0.500x)" in demo, demo
    assert "forward graph: " in demo and "all_gather" in demo, demo
    backward = next(line for line in demo.splitlines() if line.startswith("backward graph"))
    assert "all_gather" in backward and "all_reduce_sum" in backward, backward  # gloo's reductions
    # hf_trainer.py: trained, saved, and the folder loads with plain transformers
    assert "loads with plain from_pretrained" in ranks[0]["hf_trainer"]
    assert ranks[0]["hf_params"] > 0
