"""The weight export to a rollout engine, measured: ``zero3_compile.rollout.iter_full_parameters``
on a sharded Hugging Face Llama, each tensor handed to a consumer that copies it into a
preallocated bf16 buffer (as a co-located rollout engine's ``load_weights`` does) and drops it.

    python -m bench.rollout_export                        # Llama-3.2-1B's shape, 2 ranks, bf16 out
    python -m bench.rollout_export --preset 3b --world 2
    python -m bench.rollout_export --preset small         # seconds: checks that it works

Per rank: the export's time (and per tensor), the resident memory's peak above where it was
before the export (the shards are resident already), against the largest tensor and the
largest decoder layer in the export dtype: the export should cost one tensor (its gather),
not the model. The model is built on ``meta`` and initialised shard by shard
(``z3.materialize``), so no rank ever holds it whole. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from bench.harness.launch import run_ranks, set_rank_threads
from bench.harness.proc import reset_rss_high_water, settle, status_kib
from bench.harness.report import print_ranks

PRESETS = {
    # Llama-3.2-1B: 1.24B parameters (untied head here: 1.50B)
    "1b": dict(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, vocab=128256),
    # Llama-3.2-3B: 3.6B parameters with an untied head
    "3b": dict(hidden=3072, layers=28, intermediate=8192, heads=24, kv_heads=8, vocab=128256),
    "small": dict(hidden=256, layers=4, intermediate=512, heads=4, kv_heads=2, vocab=4096),
}


def _rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    import zero3_compile as z3
    from zero3_compile.rollout import iter_full_parameters

    dist.init_process_group("gloo")
    set_rank_threads(world)
    config = transformers.LlamaConfig(
        hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        intermediate_size=cfg["intermediate"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    # the rotary tables are buffers computed at construction: built for real, not on meta
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
    model.model.rotary_emb = rotary(config=config)
    z3.shard(model)
    z3.materialize(model, init_fn=model._init_weights)
    dtype = getattr(torch, cfg["dtype"])
    element = torch.empty((), dtype=dtype).element_size()
    sizes = {name: p.numel() * element for name, p in model.named_parameters()}
    layer = sum(v for k, v in sizes.items() if k.startswith("model.layers.0."))
    shard_bytes = sum(
        p.to_local().numel() * p.to_local().element_size() for p in model.parameters()
    )
    # the rollout engine's weights, preallocated before the measurement (a co-located engine
    # holds them anyway): rank 0 only, or none with --no-consumer
    consumer = {}
    if cfg["consumer"] and rank == 0:
        # resident, as an engine's loaded weights are (untouched pages would be counted as the
        # export's when the copies first write them)
        consumer = {k: torch.zeros(p.shape, dtype=dtype) for k, p in model.named_parameters()}
        for buffer in consumer.values():
            buffer.fill_(0)
    dist.barrier()
    settle()
    reset_rss_high_water()  # VmHWM back to the current resident size
    before = status_kib("VmRSS") * 1024
    start = time.perf_counter()
    count = 0
    for name, tensor in iter_full_parameters(
        model, dtype=dtype, bucket_mb=cfg["bucket_mb"], rank0_only=cfg["rank0_only"]
    ):
        if tensor is not None and name in consumer:
            consumer[name].copy_(tensor)
        del tensor
        count += 1
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") * 1024 - before
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "tensors": count,
        "seconds": round(seconds, 3),
        "ms_per_tensor": round(1000 * seconds / max(count, 1), 2),
        "peak_rss_above_start_mib": round(peak / 2**20, 1),
        "largest_tensor_mib": round(max(sizes.values()) / 2**20, 1),
        "largest_layer_mib": round(layer / 2**20, 1),
        "shards_mib": round(shard_bytes / 2**20, 1),
        "model_mib": round(sum(sizes.values()) / 2**20, 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="export dtype (cast before the gather)")
    parser.add_argument("--bucket-mb", type=float, default=0.0)
    parser.add_argument("--rank0-only", action="store_true", help="TRL-style: rank 0 receives")
    parser.add_argument("--no-consumer", action="store_true", help="drop the tensors unread")
    parser.add_argument("--json", help="write the per-rank results here")
    args = parser.parse_args(argv)
    cfg = dict(
        PRESETS[args.preset], dtype=args.dtype, bucket_mb=args.bucket_mb,
        rank0_only=args.rank0_only, consumer=not args.no_consumer,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as logs:
        results = run_ranks(
            _rank, args.world, (cfg,), log_dir=logs, name="rollout_export", timeout_s=3600
        )
    title = (f"rollout export, preset {args.preset}, {args.world} ranks, {args.dtype}, "
             f"bucket_mb={args.bucket_mb}, rank0_only={args.rank0_only}")  # fmt: skip
    print_ranks(title, results, args)


if __name__ == "__main__":
    main()
