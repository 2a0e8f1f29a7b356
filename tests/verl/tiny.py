"""A tiny Llama with its own word-level tokenizer and chat template, and a chat data set: what
verl's SFT trainer reads (a model folder, parquet files of ``messages``), made locally."""

from __future__ import annotations

import os

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    made = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    made.chat_template = CHAT_TEMPLATE
    return made


def model_folder(folder: str, *, layers: int = 2, hidden: int = 32, seed: int = 0) -> str:
    """A random-init Llama (untied head) and the tokenizer, written once."""
    import torch
    import transformers

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    made = tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(made), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=made.pad_token_id, eos_token_id=made.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    made.save_pretrained(folder)
    return folder


def chats(count: int, seed: int = 0) -> list[list[dict]]:
    import random

    rng = random.Random(seed)

    def sentence():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))

    return [
        [{"role": "user", "content": sentence()}, {"role": "assistant", "content": sentence()}]
        for _ in range(count)
    ]


def chat_parquet(path: str, count: int, seed: int = 0) -> str:
    import pandas

    if not os.path.isfile(path):
        pandas.DataFrame({"messages": chats(count, seed)}).to_parquet(path)
    return path
