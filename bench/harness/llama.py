"""Hugging Face Llama shapes and the random-init bf16 checkpoints written for them, tensor by
tensor (never the whole model): the models of big_model.py, checkpoint_load.py and
post_training.py.

Example:
    folder = write_checkpoint("/tmp/llama-125m", SHAPES["llama-125m"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    """A Llama's dimensions (``tied``: the head shares the embedding's weight)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    tied: bool = True


SHAPES = {
    "llama-125m": Shape(12, 768, 3072, 12, 4, vocab=32000),
    "llama-1b": Shape(16, 2048, 8192, 32, 8),  # Llama-3.2-1B
    "llama-1.3b": Shape(16, 2048, 8192, 32, 8, tied=False),
    "llama-1.5b": Shape(20, 2048, 8192, 32, 8),
    "llama-3b": Shape(28, 3072, 8192, 24, 8),  # Llama-3.2-3B
}


def config_of(shape: Shape, layers: int | None = None):
    """The ``transformers.LlamaConfig`` of ``shape`` (``layers``: another depth)."""
    import transformers

    return transformers.LlamaConfig(
        num_hidden_layers=layers or shape.layers,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )


# --------------------------------------------------------------------------- the checkpoint


def write_checkpoint(folder: str, shape: Shape, layers: int | None = None) -> str:
    """A random-init bf16 checkpoint written tensor by tensor (never the whole model)."""
    import transformers
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        return folder
    staging = folder + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    config = config_of(shape, layers)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    config.save_pretrained(staging)
    generator = torch.Generator().manual_seed(0)
    weight_map, file_index, pending, pending_bytes, total = {}, 0, {}, 0, 0

    def flush():
        nonlocal file_index, pending, pending_bytes
        if not pending:
            return
        name = f"model-{file_index:05d}.safetensors"
        save_file(pending, os.path.join(staging, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in pending})
        file_index, pending, pending_bytes = file_index + 1, {}, 0

    for name, param in model.state_dict().items():
        if shape.tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=torch.bfloat16)
        else:
            value = torch.empty(param.shape, dtype=torch.float32)
            value.normal_(0.0, 0.02, generator=generator)
            value = value.to(torch.bfloat16)
        pending[name] = value
        pending_bytes += value.numel() * 2
        total += value.numel() * 2
        if pending_bytes >= 2 * GiB:
            flush()
    flush()
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    os.replace(staging, folder)
    return folder


def token_batch(step: int, rank: int, seq: int, vocab: int) -> torch.Tensor:
    """Random tokens ``(1, seq)`` of step ``step`` on ``rank``: the same on every run."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (1, seq), generator=gen)
