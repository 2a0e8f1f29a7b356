"""verl's own SFT trainer (``python -m verl.trainer.sft_trainer``) trains a tiny Llama with the
zero3 engine under ``torchrun --nproc-per-node 2`` on CPU, selected by configuration alone (the
installed ``verl.plugins`` entry point registers the engine and the cpu platform): the command of
``examples/verl_sft.sh``, run as it is with CPU test settings added."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_verl_sft_trainer_trains_with_the_zero3_engine(tmp_path):
    import zero3_compile as z3

    fast = [
        # eager codegen (no Inductor compiles on 2 cores), one packed shape (no recompiles)
        "+engine.zero3_options.codegen=eager", "engine.use_torch_compile=False",
        "engine.pad_to_length=True", "engine.pad_to_length_bucket=64",
    ]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable, "STEPS": "2", "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "examples", "verl_sft.sh")
    done = subprocess.run(
        ["bash", script, str(tmp_path), *fast], capture_output=True, text=True, timeout=600, env=env
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    losses = [float(x) for x in re.findall(r"train/loss:([0-9.]+)", log)]
    assert len(losses) == 2, log[-3000:]
    assert all(0.0 < loss < 10.0 for loss in losses), losses
    # the last step saved a sealed zero3 checkpoint inside verl's step folder, with the
    # configuration and tokenizer beside it
    out = tmp_path / "checkpoints"
    step = out / "global_step_2"
    assert (step / "huggingface" / "config.json").is_file()
    manifest = z3.verify_checkpoint(str(step / "zero3"))
    assert manifest["files"], manifest
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
