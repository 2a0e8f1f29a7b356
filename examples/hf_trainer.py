"""Fine-tune a Hugging Face causal LM with ``zero3_compile.hf.Trainer`` (every rank holds 1/N).

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --out /tmp/z3hf-run
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --model path/to/hf/folder \
        --zero3-config ds_config.json

Without ``--model`` it writes a small random-init GPT-2 checkpoint first (no hub access needed)
and trains it on this file's own text, byte by byte; with ``--model`` any local folder of a
causal LM works (its tokenizer is not needed: the text is fed as bytes modulo the vocabulary).
Checkpoints land in ``--out``; run it again with ``--resume`` to continue from the newest one.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers

from zero3_compile import hf as z3hf


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face folder (default: a tiny GPT-2)")
    parser.add_argument("--out", default="z3hf-trainer-out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="of the tiny GPT-2 (tests: 1)")
    parser.add_argument("--zero3-config", help="a DeepSpeed ZeRO-3 config to translate")
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args()


def tiny_gpt2(folder: str, layers: int) -> str:
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=layers, n_head=4, n_embd=128, vocab_size=256,
                                         n_positions=256)  # fmt: skip
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    dist.barrier()
    return folder


def text_dataset(vocab: int, seq: int) -> list[dict]:
    with open(__file__, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long) % vocab
    pieces = data[: len(data) // seq * seq].view(-1, seq)
    return [{"input_ids": row, "labels": row} for row in pieces]


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    path = args.model or tiny_gpt2(os.path.join(args.out, "initial-model"), args.layers)
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, path)
    training_args = transformers.TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=3e-4,
        logging_steps=5,
        save_steps=10,
        save_total_limit=2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = z3hf.Trainer(
        model=model,
        args=training_args,
        train_dataset=text_dataset(model.config.vocab_size, args.seq),
        zero3_options={"codegen": args.codegen},
        zero3_config=args.zero3_config,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(args.out, "final"))
    if dist.get_rank() == 0:
        print(f"saved {os.path.join(args.out, 'final')}: loads with plain from_pretrained")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
