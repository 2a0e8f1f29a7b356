"""One soak job on one rank: train a small GPT with one configuration, write a bit-exact result.

Launched by ``bench/soak.py`` (one process per rank, env MASTER_ADDR/PORT, RANK, WORLD_SIZE);
only the public API is used. Rank 0 writes ``--result`` (JSON): every step's loss as
``float.hex`` and a sha256 of every rank's parameter shards, so two runs of one configuration
can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import tempfile

# every thread's stack on a fatal signal (abort, segfault) and on SIGUSR1 (the driver's hang dump)
faulthandler.enable(all_threads=True)
faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3_compile as z3  # noqa: E402
from tests.support.models import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32)
BATCH, SEQ = 4, 16  # per rank and micro-batch


def batch(step: int, micro: int, rank: int):
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def build(job: dict, offload_dir: str):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    kwargs = {"sync_timeout_s": 120}
    if job.get("mixed_precision"):
        kwargs["mp_policy"] = z3.MixedPrecision(torch.bfloat16, torch.float32)
    if job.get("hybrid"):
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh(
            "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard")
        )
    if job.get("offload"):
        kwargs["offload"] = z3.Offload(params="disk", path=offload_dir)
    z3.shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if job.get("offload"):
        opt = z3.offload_optimizer(opt, tier="disk", path=offload_dir)
    options = {"codegen": job["codegen"], **job.get("options", {})}
    return model, opt, torch.compile(model, backend="zero3", options=options)


def train_steps(job: dict, model, opt, step_model, steps, rank: int) -> list[float]:
    losses = []
    micro = job.get("accumulation", 1)
    for step in steps:
        total = 0.0
        for m in range(micro):
            last = m == micro - 1
            if micro > 1:
                z3.set_requires_gradient_sync(
                    model, last, keep_gathered=job.get("keep_gathered", False) and not last
                )
            loss = loss_of(step_model, *batch(step, m, rank)) / micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def digest(model) -> str:
    sha = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        local = param.to_local() if hasattr(param, "to_local") else param
        sha.update(name.encode())
        sha.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True, help="JSON of the configuration")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--result", required=True)
    parser.add_argument("--scratch", default=None)
    args = parser.parse_args()
    job = json.loads(args.job)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scratch = args.scratch or tempfile.mkdtemp(prefix="zero3-soak-")
    offload_dir = os.path.join(scratch, "offload")
    model, opt, step_model = build(job, offload_dir)
    steps = list(range(args.steps))
    if job.get("resume"):
        half = args.steps // 2
        losses = train_steps(job, model, opt, step_model, steps[:half], rank)
        path = os.path.join(scratch, "checkpoint")
        z3.save_checkpoint(path, model, opt, rank_state={"step": half})
        del model, opt, step_model
        torch._dynamo.reset()
        model, opt, step_model = build(job, offload_dir + "-resumed")
        state = z3.load_checkpoint(path, model, opt)
        assert state == {"step": half}, state
        losses += train_steps(job, model, opt, step_model, steps[half:], rank)
    else:
        losses = train_steps(job, model, opt, step_model, steps, rank)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(model))
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"losses": [float(x).hex() for x in losses], "digests": digests}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
