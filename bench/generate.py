"""Per-token decode latency of ``generate`` on a sharded model, beside the unsharded model and
DeepSpeed ZeRO-3's ``generate`` on the same checkpoint.

    python -m bench.generate --world 2
    python -m bench.generate --world 2 --layers 8 --hidden 768 --tokens 48 --contenders unsharded,zero3-gathered

A random-init Llama checkpoint (Hugging Face format) is written once under ``--out``. Each
contender runs in fresh processes: greedy decoding of ``--tokens`` new tokens after a prompt of
``--prompt`` tokens, three times; the per-token latency is (time for T tokens - time for 1 token)
/ (T - 1), so the prompt's prefill does not count; the median of the repeats is reported, with
every contender's tokens checked against the unsharded model's.

- ``unsharded``: the plain model in one process (the reference);
- ``zero3``: ``z3hf.from_pretrained`` on N ranks, ``model.generate`` as it is (every parameter
  is gathered at each step; ranks stay in step);
- ``zero3-gathered``: the same model inside ``with z3.gathered(model):`` (gathered once);
- ``deepspeed``: DeepSpeed ZeRO-3 on N ranks (``HfDeepSpeedConfig`` + ``from_pretrained`` under
  ``zero.Init``, ``deepspeed.initialize``), ``generate(synced_gpus=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.harness.launch import RankError, run_ranks
from bench.harness.paths import results_dir

CONTENDERS = ("unsharded", "zero3", "zero3-gathered", "deepspeed")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads per rank (default cores/world)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default=results_dir("generate"))
    return parser.parse_args(argv)


def checkpoint(args) -> str:
    import transformers

    path = os.path.join(args.out, f"llama-l{args.layers}-d{args.hidden}-v{args.vocab}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        config = transformers.LlamaConfig(
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_attention_heads=max(args.hidden // 64, 1),
            num_key_value_heads=max(args.hidden // 128, 1),
            vocab_size=args.vocab,
            max_position_embeddings=args.prompt + args.tokens + 8,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _decode(model, prompt, tokens: int, repeats: int, **kwargs) -> tuple[list[float], list[int]]:
    def run(n):
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kwargs)  # fmt: skip
        return time.perf_counter() - start, out

    run(2)  # warm-up
    per_token = []
    out = None
    for _ in range(repeats):
        one, _ = run(1)
        many, out = run(tokens)
        per_token.append((many - one) / (tokens - 1) * 1e3)
    return per_token, out[0].tolist()


def _prompt(args):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (1, args.prompt), generator=gen)


def run_unsharded(rank, world, args, path):
    import transformers

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return _decode(model, _prompt(args), args.tokens, args.repeats)


def run_zero3(rank, world, args, path, gathered):
    import torch.distributed as dist
    import transformers

    import zero3_compile as z3
    from zero3_compile import hf as z3hf

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    model = z3hf.from_pretrained(transformers.AutoModelForCausalLM, path).eval()
    with torch.no_grad():
        if gathered:
            with z3.gathered(model):
                return _decode(model, _prompt(args), args.tokens, args.repeats)
        return _decode(model, _prompt(args), args.tokens, args.repeats)


def run_deepspeed(rank, world, args, path):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "steps_per_print": 1 << 30,
    }
    keep = HfDeepSpeedConfig(config)  # noqa: F841  (must stay alive while from_pretrained runs)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.module.eval()
    with torch.no_grad():
        return _decode(engine.module, _prompt(args), args.tokens, args.repeats, synced_gpus=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) // args.world)
    os.makedirs(args.out, exist_ok=True)
    path = checkpoint(args)
    wanted = [c for c in args.contenders.split(",") if c]
    results, logs = {}, os.path.join(args.out, "logs")
    env = {"OMP_NUM_THREADS": str(args.threads), "DS_ACCELERATOR": "cpu"}
    for name in wanted:
        try:
            if name == "unsharded":
                per_rank = run_ranks(run_unsharded, 1, (args, path), log_dir=logs, name=name,
                                     timeout_s=1800, env=env)  # fmt: skip
            elif name in ("zero3", "zero3-gathered"):
                per_rank = run_ranks(run_zero3, args.world, (args, path, name != "zero3"),
                                     log_dir=logs, name=name, timeout_s=1800, env=env)  # fmt: skip
            elif name == "deepspeed":
                per_rank = run_ranks(run_deepspeed, args.world, (args, path), log_dir=logs,
                                     name=name, timeout_s=1800, env=env)  # fmt: skip
            else:
                raise SystemExit(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")
        except RankError as error:
            print(f"{name}: failed: {str(error).splitlines()[0]}")
            continue
        times, tokens = per_rank[0]
        results[name] = {"ms_per_token": statistics.median(times), "runs": times, "tokens": tokens}
    reference = results.get("unsharded")
    lines = [
        f"# generate: Llama {args.layers} layers, d {args.hidden}, vocab {args.vocab}; prompt "
        f"{args.prompt}, {args.tokens} new tokens, greedy; {args.world} ranks, "
        f"{args.threads} thread(s) each; torch {torch.__version__}",
        "",
        "| contender | ms per token (median) | vs unsharded | same tokens |",
        "|---|---:|---:|---|",
    ]
    for name, r in results.items():
        ratio = f"{r['ms_per_token'] / reference['ms_per_token']:.2f}x" if reference else "-"
        same = "yes" if reference and r["tokens"] == reference["tokens"] else "no"
        lines.append(f"| {name} | {r['ms_per_token']:.1f} | {ratio} | {same} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
