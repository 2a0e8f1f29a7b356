"""Your own training loop with accelerate and a zero3-sharded Hugging Face model.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # CPUs too
    accelerate launch --multi_gpu --num_processes 8 examples/accelerate_loop.py --model path

An ordinary accelerate loop: only the import of ``Accelerator`` changes
(``from zero3_compile.hf import Accelerator``), whose ``prepare`` shards the model and compiles
it with the zero3 backend instead of wrapping it in DDP, and whose ``accumulate`` reduces the
gradients only on the micro-batch where accelerate syncs. (``accelerate launch`` has no
``--multi_cpu`` flag, accelerate 1.16 neither, and its ``--cpu`` starts one process unless given
an MPI hostfile: ``--multi_gpu`` starts the processes with torchrun, and on a machine without
GPUs the script's ``Accelerator(cpu=True)`` makes them a gloo job.)

Same data and model as ``examples/hf_trainer.py``. Prints the loss of every step and, at the end,
each rank's share of the parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from accelerate.utils import set_seed

from zero3_compile import hf as z3hf
from zero3_compile.hf import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face folder (default: a tiny GPT-2)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--codegen", default="eager", choices=["inductor", "eager"])
    args = parser.parse_args()

    # cpu=True without a GPU: accelerate then runs the processes torchrun started as MULTI_CPU
    # (gloo); with GPUs it is MULTI_GPU (nccl)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulation,
        cpu=not torch.cuda.is_available(),
        zero3_options={"codegen": args.codegen},
    )
    folder = args.model or os.path.join("z3hf-accelerate-out", "initial-model")
    if args.model is None and accelerator.is_main_process and not os.path.isdir(folder):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256,
                                         n_positions=128)  # fmt: skip
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    accelerator.wait_for_everyone()
    set_seed(0)  # the same data order however the processes were started
    accelerator.print(f"{accelerator.distributed_type}, {accelerator.num_processes} processes")
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, folder)

    with open(__file__, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long) % model.config.vocab_size
    rows = data[: len(data) // 32 * 32].view(-1, 32)
    loader = torch.utils.data.DataLoader(rows, batch_size=2, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    step_model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, loader, scheduler
    )  # the model sharded already (from_pretrained), compiled with the zero3 backend
    step = 0
    for batch in loader:
        with accelerator.accumulate(step_model):
            loss = step_model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            accelerator.print(f"step {step}: loss {loss.item():.4f}")
            if step == args.steps:
                break
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    # one write of a whole line: the ranks share the launcher's stdout
    print(
        f"rank {accelerator.process_index}: {local} of {total} parameters held\n",
        end="",
        flush=True,
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
