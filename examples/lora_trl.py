"""LoRA with TRL on zero3: a model sharded as it loads, TRL's DPO (or SFT) training only the
adapters, the adapter and the merged model saved as plain folders.

    torchrun --standalone --nproc-per-node 2 examples/lora_trl.py --out /tmp/lora-trl
    torchrun --standalone --nproc-per-node 2 examples/lora_trl.py --trainer sft
    torchrun --standalone --nproc-per-node 2 examples/lora_trl.py --model path/to/hf/folder

Without ``--model`` it writes a small random-init Llama and a character-level tokenizer first
(no hub access needed); with ``--model`` any local folder of a causal LM with its tokenizer
works. The data are a few preference pairs made up here (DPO) or their preferred texts (SFT).
The frozen base stays sharded (1/N per rank; add ``offload=z3.Offload(params="disk")`` to
``from_pretrained`` to keep it on disk); DPO's reference is the model with its adapter disabled,
as TRL does with peft. At the end rank 0 loads both saved folders back with plain peft and
transformers.
"""

from __future__ import annotations

import argparse
import os
import string

import torch
import torch.distributed as dist
import transformers

from zero3_compile import hf as z3hf
from zero3_compile.hf import trl as z3trl

PAIRS = [
    ("the sky is", " blue and wide.", " made of cheese."),
    ("two plus two is", " four.", " seven or so."),
    ("water boils at", " one hundred degrees.", " any old time."),
    ("a cat says", " meow.", " quack quack."),
    ("the sun rises in the", " east.", " basement."),
    ("ice is", " frozen water.", " a kind of fish."),
    ("bees make", " honey.", " small cars."),
    ("a week has", " seven days.", " nine or ten."),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face folder (default: a tiny Llama)")
    parser.add_argument("--out", default="lora-trl-out")
    parser.add_argument("--trainer", default="dpo", choices=["dpo", "sft"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    return parser.parse_args()


def tiny_llama(folder: str) -> str:
    """A random-init Llama and a character tokenizer (rank 0 writes them once)."""
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(folder, "config.json")):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
        for char in string.ascii_lowercase + string.digits + " .,!?":
            vocab[char] = len(vocab)
        core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        core.decoder = decoders.Fuse()
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
        )
        config = transformers.LlamaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
            intermediate_size=128, vocab_size=len(vocab), tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=1, bos_token_id=2,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    dist.barrier()
    return folder


def main() -> None:
    import datasets
    import peft
    import trl

    args = parse_args()
    dist.init_process_group()
    folder = args.model or tiny_llama(os.path.join(args.out, "tiny-llama"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    # each rank reads only its rows of the checkpoint: the model is never whole on a rank
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, folder)
    lora = peft.LoraConfig(
        r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )  # fmt: skip
    common = dict(
        output_dir=os.path.join(args.out, "run"), per_device_train_batch_size=2,
        max_steps=args.steps, learning_rate=5e-3, logging_steps=1, save_strategy="no",
        report_to=[], bf16=False, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    if args.trainer == "dpo":
        data = datasets.Dataset.from_dict(
            {k: [p[i] for p in PAIRS] for i, k in enumerate(("prompt", "chosen", "rejected"))}
        )
        trainer = z3trl.DPOTrainer(
            model=model, args=trl.DPOConfig(**common, max_length=64), train_dataset=data,
            processing_class=tokenizer, peft_config=lora,
            zero3_options={"codegen": args.codegen},
        )  # fmt: skip
    else:
        data = datasets.Dataset.from_dict({"text": [p[0] + p[1] for p in PAIRS]})
        trainer = z3trl.SFTTrainer(
            model=model, args=trl.SFTConfig(**common, max_length=64), train_dataset=data,
            processing_class=tokenizer, peft_config=lora,
            zero3_options={"codegen": args.codegen},
        )  # fmt: skip
    trainer.train()
    adapter_dir = os.path.join(args.out, "adapter")
    merged_dir = os.path.join(args.out, "merged")
    trainer.save_model(adapter_dir)  # adapter_config.json + adapter_model.safetensors
    z3hf.save_pretrained(trainer.model, merged_dir, merge_adapters=True)  # a plain folder
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        base = transformers.AutoModelForCausalLM.from_pretrained(folder)
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir)
        merged, info = transformers.AutoModelForCausalLM.from_pretrained(
            merged_dir, output_loading_info=True
        )
        ids = tokenizer(PAIRS[0][0], return_tensors="pt").input_ids
        with torch.no_grad():
            same = torch.allclose(adapted(ids).logits, merged(ids).logits, atol=1e-5)
        trained = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
        print(f"{args.trainer}: losses {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"adapter: {trained} parameters in {adapter_dir}; merged model in {merged_dir} "
              f"(missing keys: {sorted(info['missing_keys'])}); same logits: {same}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
