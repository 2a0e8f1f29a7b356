"""One PPO-style actor cycle of verl with the zero3 engine, time per phase (run in the verl
environment: docs/guides/verl.md):

    export (weights to the rollout engine) -> offload (engine.to("cpu")) -> [rollout]
    -> reload (engine.to(device)) -> train_batch (verl's PPO actor loss) -> next cycle

    python -m bench.verl_cycle                     # a 125M-class Llama, 2 ranks, 2 cycles
    python -m bench.verl_cycle --preset small      # seconds: checks that it works

The engine is built through verl's ``EngineRegistry`` (``strategy=zero3``) from a random-init
Hugging Face checkpoint written once under ``--cache``. On a GPU machine offload and reload are
``engine.to("cpu")`` / ``engine.to("cuda")``; on a CPU machine ``to()`` has nothing to move
(the shards are in host memory), so the bench times the same offload code with its disk tier
(``--offload-tier``). The export is ``get_per_tensor_param()`` consumed tensor by tensor (bf16
copies, as a rollout engine loads them). The last cycle's times are the warm ones. Run it alone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial

from bench.harness.launch import run_ranks
from bench.harness.report import print_ranks

PRESETS = {
    # ~125M parameters with the head (GPT-2 small's width and depth, a 32k vocabulary)
    "125m": dict(hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, vocab=32000),
    "small": dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=512),
}
WORDS = [f"w{i}" for i in range(40)]


def write_checkpoint(folder: str, cfg: dict) -> str:
    """A random-init Llama and a word-level tokenizer (verl reads both from the folder)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    special = ["<unk>", "<pad>", "<eos>"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(special + WORDS)}, "<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    config = transformers.LlamaConfig(
        hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        intermediate_size=cfg["intermediate"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
        tie_word_embeddings=False, pad_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _batch(rows: int, prompt: int, response: int, vocab: int, micro: int, seed: int):
    """A PPO actor batch as verl's trainer hands it to the engine (no padding, nested)."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (rows, prompt), generator=g)
    responses = torch.randint(3, vocab, (rows, response), generator=g)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    data = tu.get_tensordict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(dim=1) - 1),
            "response_mask": torch.ones(rows, response, dtype=torch.long),
            "old_log_probs": -10 + 0.1 * torch.randn(rows, response, generator=g),
            "advantages": torch.randn(rows, response, generator=g),
        }
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data, temperature=1.0, use_remove_padding=False, use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro, global_batch_size=rows, pad_mode="no_padding",
        calculate_entropy=False, use_fused_kernels=False,
    )  # fmt: skip
    return data


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.actor import FSDPActorConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    from zero3_compile.verl import Zero3EngineConfig

    dist.init_process_group("gloo" if get_device_name() == "cpu" else "nccl")
    if get_device_name() == "cuda":
        torch.cuda.set_device(rank)
    model = HFModelConfig(
        path=cfg["folder"], override_config={"attn_implementation": "sdpa"},
        use_remove_padding=False, enable_gradient_checkpointing=True,
    )  # fmt: skip
    model.model_type = "language_model"
    engine_config = Zero3EngineConfig(
        zero3_options=dict(cfg["zero3_options"]), use_torch_compile=False,
        use_dynamic_bsz=False, micro_batch_size_per_gpu=cfg["micro"],
        param_offload=True, optimizer_offload=True,
    )  # fmt: skip
    engine = EngineRegistry.new(
        model_type="language_model", backend="zero3", model_config=model,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-6, total_training_steps=100),
        checkpoint_config=CheckpointConfig(),
    )  # fmt: skip
    engine.initialize()
    actor = FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_mini_batch_size=cfg["rows"],
        ppo_micro_batch_size_per_gpu=cfg["micro"], use_dynamic_bsz=False,
    )  # fmt: skip
    loss_fn = partial(ppo_loss, config=actor)
    on_gpu = get_device_name() == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    cycles = []
    for cycle in range(cfg["cycles"]):
        times = {}

        def phase(name, fn, times=times):
            dist.barrier()
            sync()
            start = time.perf_counter()
            fn()
            sync()
            dist.barrier()
            times[name] = round(time.perf_counter() - start, 3)

        def export():
            generator, _ = engine.get_per_tensor_param()
            for _, tensor in generator:
                tensor.to(torch.bfloat16)
                del tensor

        def offload():
            if on_gpu:
                engine.to("cpu", model=True, optimizer=True, grad=True)
            else:
                engine._offload(cfg["offload_tier"], model=True, optimizer=True, grad=True)

        def reload():
            if on_gpu:
                engine.to("cuda", model=True, optimizer=True, grad=True)
            else:
                engine._reload()

        def train(cycle=cycle):
            data = _batch(cfg["rows"], cfg["prompt"], cfg["response"], cfg["vocab"],
                          cfg["micro"], seed=cycle)  # fmt: skip
            share = tu.chunk_tensordict(data, world)[rank]
            with engine.train_mode(disable_auto_offload=True):
                engine.train_batch(share, loss_function=loss_fn)

        phase("export", export)
        phase("offload", offload)
        if on_gpu:
            times["gpu_allocated_after_offload_mib"] = round(torch.cuda.memory_allocated() / 2**20)
        phase("reload", reload)
        phase("train_batch", train)
        cycles.append(times)
    dist.destroy_process_group()
    return {"rank": rank, "cycles": cycles}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="125m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="sequences per actor update")
    parser.add_argument("--micro", type=int, default=2, help="micro-batch size per rank")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--codegen", default="eager", help="zero3 codegen: eager or inductor")
    parser.add_argument("--offload-tier", default="disk", help="CPU machines: where to offload")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "zero3-verl-cycle"))
    parser.add_argument("--json", help="write the per-rank results here")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    folder = write_checkpoint(os.path.join(args.cache, args.preset), preset)
    cfg = dict(
        preset, folder=folder, cycles=args.cycles, rows=args.rows, micro=args.micro,
        prompt=args.prompt, response=args.response, offload_tier=args.offload_tier,
        zero3_options={"codegen": args.codegen},
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as logs:
        results = run_ranks(_rank, args.world, (cfg,), log_dir=logs, name="verl_cycle",
                            timeout_s=3600)  # fmt: skip
    title = f"verl actor cycle, preset {args.preset}, {args.world} ranks, codegen {args.codegen}"
    print_ranks(title, results, args)


if __name__ == "__main__":
    main()
