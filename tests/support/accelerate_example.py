"""An accelerate training script as accelerate's examples write them: a causal LM (a tiny Llama
from its config), gradient accumulation, clipping, a schedule, ``save_state`` at a step and
``load_state`` to resume. ``Z3=1`` changes one import: ``from zero3_compile.hf import
Accelerator``; nothing else differs.

    python tests/support/accelerate_example.py out/                                    # plain accelerate
    Z3=1 accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 \\
        --deepspeed_config_file ds.json tests/support/accelerate_example.py out/         # zero3

Prints one JSON line per process at the end (rank 0's has the losses).
"""

from __future__ import annotations

import json
import os
import sys

import torch

if os.environ.get("Z3") == "1":
    from zero3_compile.hf import Accelerator
else:
    from accelerate import Accelerator

GLOBAL_BATCH = 4  # rows per micro-batch over all processes
ACCUMULATION = 2
STEPS = 4
SAVE_AT = 2  # optimizer steps before save_state


def tiny_llama():
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, vocab_size=101, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 101, (GLOBAL_BATCH * ACCUMULATION * STEPS, 12), generator=gen)


def train(folder: str, resume: bool = False) -> dict:
    """Train ``STEPS`` optimizer steps, saving the state after ``SAVE_AT``; or resume there."""
    import transformers
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION)
    set_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, STEPS)
    loader = torch.utils.data.DataLoader(
        data(), batch_size=GLOBAL_BATCH // accelerator.num_processes, shuffle=False
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    checkpoint = os.path.join(folder, "checkpoint")
    step, losses, norms = 0, [], []
    if resume:
        accelerator.load_state(checkpoint)
        step = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT * ACCUMULATION)
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
        if accelerator.sync_gradients:
            step += 1
            if step == SAVE_AT and not resume:
                accelerator.save_state(checkpoint)
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    return {
        "losses": losses,
        "norms": norms,
        "lr": scheduler.get_last_lr()[0],
        "params": {k: v.detach().clone() for k, v in state.items()},
        "unwrapped": type(unwrapped).__name__,
        "processes": accelerator.num_processes,
    }


if __name__ == "__main__":
    out = train(sys.argv[1], resume="--resume" in sys.argv)
    digest = {k: v for k, v in out.items() if k != "params"}
    digest["param_sum"] = sum(v.double().sum().item() for v in out["params"].values())
    print(json.dumps(digest), flush=True)
