#!/usr/bin/env bash
# verl's own SFT trainer with the zero3 engine, on 2 CPU ranks: a tiny Llama (random weights, a
# word-level tokenizer with a chat template) and a chat data set are written to OUT first.
#
#   pip install torch==2.13.0 -e ".[dev]" "verl==0.9.1"     # see docs/guides/verl.md
#   bash examples/verl_sft.sh [OUT] [more hydra overrides...]   # STEPS=4, PYTHON=python
#
# The zero3 lines are the two engine.* lines below; everything else is an ordinary verl SFT
# command. On a GPU machine drop the CPU settings (trainer.device, the attention override).
set -euo pipefail
OUT="${1:-/tmp/zero3-verl-sft}"
shift || true
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"

"$PYTHON" - "$OUT" <<'EOF'
import os, random, sys

import pandas
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

out = sys.argv[1]
words = [f"w{i}" for i in range(40)]
special = ["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
if not os.path.isfile(os.path.join(out, "model", "config.json")):
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + words)}, "<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(out, "model"))
    tokenizer.save_pretrained(os.path.join(out, "model"))
rng = random.Random(0)
sentence = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))  # noqa: E731
chats = [[{"role": "user", "content": sentence()}, {"role": "assistant", "content": sentence()}]
         for _ in range(32)]
pandas.DataFrame({"messages": chats}).to_parquet(os.path.join(out, "train.parquet"))
EOF

"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 -m verl.trainer.sft_trainer \
    engine._target_=zero3_compile.verl.Zero3EngineConfig \
    engine.strategy=zero3 \
    model.path="$OUT/model" \
    data.train_files="$OUT/train.parquet" data.val_files=null \
    data.train_batch_size=8 data.micro_batch_size_per_gpu=2 data.use_dynamic_bsz=False \
    data.max_length=64 data.num_workers=0 \
    trainer.total_training_steps="${STEPS:-4}" trainer.logger=[console] \
    trainer.default_local_dir="$OUT/checkpoints" trainer.n_gpus_per_node=2 \
    trainer.device=cpu +model.override_config.attn_implementation=sdpa \
    "$@"
