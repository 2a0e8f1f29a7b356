"""verl's own SFT trainer (``python -m verl.trainer.sft_trainer``) trains a tiny Llama with the
zero3 engine under ``torchrun --nproc-per-node 2`` on CPU, selected by configuration alone (the
installed ``verl.plugins`` entry point registers the engine and the cpu platform)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.verl import tiny

# the lines a verl user adds to an FSDP SFT command (docs/guides/verl.md)
ZERO3 = [
    "engine._target_=zero3_compile.verl.Zero3EngineConfig",
    "engine.strategy=zero3",
]


def test_verl_sft_trainer_trains_with_the_zero3_engine(tmp_path):
    import zero3_compile as z3

    model = tiny.model_folder(str(tmp_path / "model"))
    data = tiny.chat_parquet(str(tmp_path / "train.parquet"), 32)
    out = tmp_path / "checkpoints"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "verl.trainer.sft_trainer",
        f"data.train_files={data}", "data.val_files=null", "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=False", "data.max_length=64",
        "data.num_workers=0",
        f"model.path={model}", "+model.override_config.attn_implementation=sdpa",
        *ZERO3,
        # CPU test settings: fast compiles, one packed shape (no recompiles), no Inductor
        "+engine.zero3_options.codegen=eager", "engine.use_torch_compile=False",
        "engine.pad_to_length=True", "engine.pad_to_length_bucket=64",
        "trainer.total_training_steps=2", "trainer.logger=[console]", "trainer.device=cpu",
        f"trainer.default_local_dir={out}", "trainer.n_gpus_per_node=2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    losses = [float(x) for x in re.findall(r"train/loss:([0-9.]+)", log)]
    assert len(losses) == 2, log[-3000:]
    assert all(0.0 < loss < 10.0 for loss in losses), losses
    # the last step saved a sealed zero3 checkpoint inside verl's step folder, with the
    # configuration and tokenizer beside it
    step = out / "global_step_2"
    assert (step / "huggingface" / "config.json").is_file()
    manifest = z3.verify_checkpoint(str(step / "zero3"))
    assert manifest["files"], manifest
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
