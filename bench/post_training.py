"""Post-training at real size: LoRA on a frozen base kept on disk, a full fine-tune beside it,
and GRPO's generate + train cycle (run each alone on the machine).

    python -m bench.post_training lora --model llama-8b --world 2 --steps 4
    python -m bench.post_training full --model llama-1b --world 2 --steps 4
    python -m bench.post_training grpo --model llama-125m --world 2 --cycles 3
    python -m bench.post_training lora --model tiny --steps 3 --no-disk-test   # seconds: a check

``lora``: a random-init bf16 Hugging Face checkpoint (written once under ``--cache``, tensor by
tensor) loaded with ``z3hf.from_pretrained(..., offload=z3.Offload(params="disk"))``: the frozen
base's bf16 shards stay in the offload files (read from disk when gathered, never written back:
it is never updated), ``peft.get_peft_model`` adds LoRA adapters (``--lora-rank``, every linear
layer of the blocks) that live in memory as fp32 shards with their AdamW state; the model is
compiled with the zero3 backend and trained on random tokens. ``full``: the same checkpoint
trained whole, fp32 master shards (computed in ``--compute``, a ``z3.MixedPrecision``: bf16 with
CUDA, fp32 on a CPU whose bf16 matmul is slow; the LoRA base is then upcast); with ``--offload
disk`` (the default) parameters and AdamW state on disk (``z3.offload_optimizer``), with
``none`` in memory. Per phase and rank: wall time, the peak resident memory (``VmHWM`` reset at
the start of the phase), the bytes the offload stores read and wrote. Beside the steady step:
the disk's sequential read rate (``O_DIRECT``, ``bench/big_model.py``'s test; ``--no-disk-test``
skips it), the step's disk bound (bytes read per step / that rate) and, with
``--compute-layers 1,2``, its compute bound (the same run in memory at those depths, a line
fitted and extrapolated to the full depth): the step against max(compute, disk).

``grpo``: ``zero3_compile.hf.trl.GRPOTrainer`` on a random-init checkpoint with a word-level
tokenizer, a deterministic reward (distinct words in the completion), ``--cycles`` optimizer
steps, each generating ``--generations`` completions of up to ``--completion`` tokens per prompt
and training on them. Twice: generation gathered (``ds3_gather_for_generation=True``: the model
gathered once per generation, no collective per token) and streamed (``False``: each forward
gathers layer by layer, ranks kept in step). Per cycle: generation, scoring (rewards and the old
log-probabilities), the training step; the last cycle is the warm one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from bench.harness.disk import disk_bandwidth
from bench.harness.launch import run_ranks, set_rank_threads
from bench.harness.llama import SHAPES as BIG_SHAPES
from bench.harness.llama import Shape, token_batch, write_checkpoint
from bench.harness.phases import Phases

SHAPES = {
    **BIG_SHAPES,
    "llama-8b": Shape(32, 4096, 14336, 32, 8, vocab=128256, tied=False),  # Llama-3-8B
    "tiny": Shape(2, 64, 128, 4, 2, vocab=512, tied=False),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --------------------------------------------------------------------------- lora / full


def run_training(rank: int, world: int, cfg: dict) -> dict:
    """One LoRA or full fine-tune run on this rank (``cfg["mode"]``)."""
    import peft
    import torch.distributed as dist
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    set_rank_threads(world)
    dist.init_process_group("gloo")
    phases = Phases(cfg["scratch"])
    lora = cfg["mode"] == "lora"
    scratch = os.path.join(cfg["scratch"], f"{cfg['tag']}")
    offload = z3.Offload(params="disk", path=scratch) if cfg["offload"] == "disk" else None
    with phases.phase("load"):
        compute = getattr(torch, cfg["compute"])
        if lora:  # the base in bf16 as stored, gathered and computed in --compute
            policy = None if compute == torch.bfloat16 else z3.MixedPrecision(compute)
            model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, cfg["checkpoint"],
                                         dtype=torch.bfloat16, offload=offload,
                                         mp_policy=policy)  # fmt: skip
            adapters = peft.LoraConfig(r=cfg["lora_rank"], lora_alpha=2 * cfg["lora_rank"],
                                       target_modules=LORA_TARGETS, lora_dropout=0.0)  # fmt: skip
            model = peft.get_peft_model(model, adapters)
        else:  # fp32 master shards, gathers and compute in --compute
            policy = None if compute == torch.float32 else z3.MixedPrecision(compute, torch.float32)
            model = z3hf.from_pretrained(
                transformers.AutoModelForCausalLM, cfg["checkpoint"], dtype=torch.float32,
                offload=offload, mp_policy=policy,
            )  # fmt: skip
        model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    if not lora and offload is not None:
        opt = z3.offload_optimizer(opt, tier="disk", path=scratch)
    phases.model, phases.opt = model, opt
    step_model = torch.compile(model, backend="zero3", options={"codegen": cfg["codegen"]})
    losses = []

    def step(i: int) -> None:
        ids = token_batch(i, rank, cfg["seq"], cfg["vocab"])
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    with phases.phase("first step (compiles)"):
        step(0)
    times = []
    with phases.phase("steps"):
        for i in range(1, cfg["steps"]):
            start = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    count = sum(p.numel() for p in model.parameters())  # shards: this rank's part
    return {
        "phases": phases.records,
        "losses": losses,
        "step_s": statistics.median(times) if times else None,
        "trainable_local": sum(p.to_local().numel() for p in trainable),
        "params_local": sum(p.to_local().numel() for p in model.parameters()),
        "params": count,
    }


def compute_bound(args, shape: Shape, base: dict, logs: str) -> float | None:
    """The step in memory (no offload) at ``--compute-layers`` depths, fitted and extrapolated
    to the model's depth."""
    depths = [int(d) for d in args.compute_layers.split(",") if d] if args.compute_layers else []
    if len(depths) < 2:
        return None
    samples = []
    for depth in depths:
        folder = write_checkpoint(os.path.join(args.cache, f"{args.model}-l{depth}"), shape, depth)
        cfg = {**base, "checkpoint": folder, "offload": "none", "tag": f"compute-l{depth}"}
        ranks = run_ranks(run_training, args.world, (cfg,), log_dir=logs,
                          name=f"compute-l{depth}", timeout_s=7200)  # fmt: skip
        seconds = max(r["step_s"] for r in ranks)
        samples.append((depth, seconds))
        print(f"compute alone: {seconds:.2f} s a step at {depth} layers", flush=True)
    line = statistics.linear_regression([d for d, _ in samples], [s for _, s in samples])
    return line.intercept + line.slope * shape.layers


def train_report(args, shape: Shape, ranks: list[dict], disk: dict | None,
                 compute: float | None) -> dict:  # fmt: skip
    steady = [r["phases"]["steps"] for r in ranks]
    per_step = max(1, args.steps - 1)
    step_s = max(r["step_s"] or 0.0 for r in ranks)
    read = max(p["store_read"] for p in steady) / per_step
    written = max(p["store_written"] for p in steady) / per_step
    summary = {
        "mode": args.mode,
        "model": args.model,
        "world": args.world,
        "compute": args.compute,
        "params": ranks[0]["params"],
        "trainable_per_rank": [r["trainable_local"] for r in ranks],
        "step_s": step_s,
        "peak_rss_gb": {
            name: [round(r["phases"][name]["peak_rss"] / 1e9, 2) for r in ranks]
            for name in ranks[0]["phases"]
        },
        "store_read_mb_per_step": round(read / 1e6, 2),
        "store_written_mb_per_step": round(written / 1e6, 2),
        "losses": ranks[0]["losses"],
    }
    if disk is not None:
        summary["disk_read_gbps"] = round(disk["read_gbps"], 2)
        summary["disk_bound_s"] = round(read / (disk["read_gbps"] * 1e9), 2)
    if compute is not None:
        summary["compute_bound_s"] = round(compute, 2)
    bounds = [summary.get("disk_bound_s"), summary.get("compute_bound_s")]
    bounds = [b for b in bounds if b]
    if bounds and step_s:
        summary["step_over_bound"] = round(step_s / max(bounds), 2)
    return summary


def main_training(args, logs: str) -> dict:
    shape = SHAPES[args.model]
    checkpoint = write_checkpoint(os.path.join(args.cache, args.model), shape)
    scratch = tempfile.mkdtemp(prefix="post-training-", dir=args.scratch)
    base = dict(
        mode=args.mode, checkpoint=checkpoint, scratch=scratch, offload=args.offload,
        steps=args.steps, seq=args.seq, vocab=shape.vocab, codegen=args.codegen,
        lora_rank=args.lora_rank, compute=args.compute, tag="run",
    )  # fmt: skip
    ranks = run_ranks(run_training, args.world, (base,), log_dir=logs, name=args.mode,
                      timeout_s=7200)  # fmt: skip
    disk = None if args.no_disk_test else disk_bandwidth(scratch)
    compute = compute_bound(args, shape, base, logs)
    return train_report(args, shape, ranks, disk, compute)


# --------------------------------------------------------------------------- grpo


def write_tokenizer(folder: str, vocab: int) -> None:
    """A word-level tokenizer over the whole vocabulary ("w0" ... ), so every token decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return
    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(folder)  # fmt: skip


def _distinct_words(completions, **kwargs) -> list[float]:
    return [float(len(set(text.split()))) for text in completions]


def run_grpo(rank: int, world: int, cfg: dict) -> dict:
    import datasets
    import torch.distributed as dist
    import transformers
    import trl

    from zero3_compile import hf as z3hf
    from zero3_compile.hf import trl as z3trl

    set_rank_threads(world)
    dist.init_process_group("gloo")
    times: list[dict] = []

    class Timed(z3trl.GRPOTrainer):
        """Times each cycle's parts: generation, scoring, the training step."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            times.append({"generate": 0.0, "prepare": 0.0})
            start = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            times[-1]["step"] = time.perf_counter() - start
            return loss

        def _prepare_inputs(self, batch):
            start = time.perf_counter()
            prepared = super()._prepare_inputs(batch)
            times[-1]["prepare"] += time.perf_counter() - start
            return prepared

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            times[-1]["generate"] += time.perf_counter() - start
            return out

    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg["checkpoint"])
    generator = torch.Generator().manual_seed(0)
    prompts = [
        " ".join(
            f"w{int(t)}"
            for t in torch.randint(2, cfg["vocab"], (cfg["prompt"],), generator=generator)
        )  # fmt: skip
        for _ in range(64)
    ]
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, cfg["checkpoint"],
                                 dtype=getattr(torch, cfg["compute"]))  # fmt: skip
    args = trl.GRPOConfig(
        output_dir=os.path.join(cfg["scratch"], cfg["tag"]), per_device_train_batch_size=cfg["rows"],
        num_generations=cfg["generations"], max_completion_length=cfg["completion"],
        max_steps=cfg["cycles"], learning_rate=1e-6, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
        ds3_gather_for_generation=cfg["gather"],
    )  # fmt: skip
    trainer = Timed(model=model, reward_funcs=_distinct_words, args=args,
                    train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                    processing_class=tokenizer,
                    zero3_options={"codegen": cfg["codegen"]})  # fmt: skip
    trainer.train()
    dist.barrier()
    dist.destroy_process_group()
    cycles = [
        {
            "generate_s": round(t["generate"], 3),
            "score_s": round(t["prepare"] - t["generate"], 3),
            "train_s": round(t["step"] - t["prepare"], 3),
            "cycle_s": round(t["step"], 3),
        }
        for t in times
    ]
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history]
    return {"cycles": cycles, "mean_completion_length": [x for x in lengths if x is not None]}


def main_grpo(args, logs: str) -> dict:
    shape = SHAPES[args.model]
    folder = write_checkpoint(os.path.join(args.cache, args.model), shape)
    write_tokenizer(folder, shape.vocab)
    scratch = tempfile.mkdtemp(prefix="post-training-grpo-", dir=args.scratch)
    summary = {"mode": "grpo", "model": args.model, "world": args.world, "compute": args.compute}
    for gather in (True, False):
        name = "gathered" if gather else "streamed"
        cfg = dict(
            checkpoint=folder, scratch=scratch, tag=name, gather=gather, vocab=shape.vocab,
            rows=args.rows, generations=args.generations, completion=args.completion,
            prompt=args.prompt, cycles=args.cycles, codegen=args.codegen, compute=args.compute,
        )  # fmt: skip
        ranks = run_ranks(run_grpo, args.world, (cfg,), log_dir=logs, name=f"grpo-{name}",
                          timeout_s=7200)  # fmt: skip
        summary[name] = {"per_rank": ranks, "warm_cycle": ranks[0]["cycles"][-1]}
        print(f"grpo, generation {name}: warm cycle {ranks[0]['cycles'][-1]}", flush=True)
    return summary


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("lora", "full", "grpo"))
    parser.add_argument("--model", choices=sorted(SHAPES), default=None,
                        help="default: llama-8b (lora), llama-1b (full), llama-125m (grpo)")  # fmt: skip
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="lora/full: optimizer steps")
    parser.add_argument("--seq", type=int, default=512, help="lora/full: tokens per rank")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--offload", choices=("disk", "none"), default="disk")
    parser.add_argument("--compute-layers", default="", help="e.g. 1,2: the compute bound")
    parser.add_argument("--no-disk-test", action="store_true")
    parser.add_argument("--cycles", type=int, default=3, help="grpo: optimizer steps")
    parser.add_argument("--rows", type=int, default=4, help="grpo: completions per rank")
    parser.add_argument("--generations", type=int, default=4, help="grpo: per prompt")
    parser.add_argument("--completion", type=int, default=64, help="grpo: max new tokens")
    parser.add_argument("--prompt", type=int, default=32, help="grpo: prompt words")
    parser.add_argument("--codegen", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--compute", choices=("bfloat16", "float32"), default=None,
                        help="the dtype gathered and computed in; default bfloat16 "
                        "with CUDA, float32 on CPU (without AVX512-BF16/AMX, torch's bf16 "
                        "matmul takes a reference path: 0.2 GFLOPS against 78 in fp32 measured "
                        "on the 2-core EPYC of bench/RESULTS.md)")  # fmt: skip
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "zero3-bench"))
    parser.add_argument("--scratch", default=None, help="offload files (default: a temp dir)")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = {"lora": "llama-8b", "full": "llama-1b", "grpo": "llama-125m"}[args.mode]
    if args.compute is None:
        args.compute = "bfloat16" if torch.cuda.is_available() else "float32"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as logs:
        summary = main_grpo(args, logs) if args.mode == "grpo" else main_training(args, logs)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
