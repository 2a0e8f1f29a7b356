"""Tiny Hugging Face checkpoints for the tests, written with plain transformers (no hub)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 101


def config(kind: str):
    import transformers

    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    if kind == "gpt2":  # tied embeddings and head
        return transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=VOCAB,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    if kind == "llama":  # untied head, rotary buffers
        return transformers.LlamaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=64, tie_word_embeddings=False, **common,
        )  # fmt: skip
    if kind == "mixtral":  # experts stacked on load, written back one by one
        return transformers.MixtralConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, **common,
        )  # fmt: skip
    raise ValueError(kind)


def write(folder: str, kind: str, *, seed: int = 0, max_shard_size: str = "20KB") -> str:
    """A random-init checkpoint of ``kind`` in several files (an index), written once."""
    import transformers

    if not os.path.isfile(os.path.join(folder, "config.json")):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config(kind))
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def without(folder: str, target: str, key_suffix: str) -> str:
    """A copy of the checkpoint at ``folder`` without the tensors whose names end so."""
    from safetensors.torch import load_file, save_file

    os.makedirs(target, exist_ok=True)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    for name in os.listdir(folder):
        source = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            tensors = {k: v for k, v in load_file(source).items() if not k.endswith(key_suffix)}
            save_file(tensors, os.path.join(target, name), metadata={"format": "pt"})
        elif name != "model.safetensors.index.json":
            with open(source, "rb") as f, open(os.path.join(target, name), "wb") as g:
                g.write(f.read())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if not k.endswith(key_suffix)
    }
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return target


def token_data(n: int = 16, seq: int = 12, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=gen)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]
