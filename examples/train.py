"""Train a GPT with ZeRO-3 through torch.compile; checkpoint, and resume exactly after a failure.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train.py \\
        --checkpoint-dir ckpt --checkpoint-every 5

Each rank keeps 1/N of the parameters, gradients and AdamW state (``zero3_compile.shard``) and the
model runs through ``torch.compile(backend="zero3")``; AdamW with gradient clipping, a warmup +
cosine LR schedule, and a seeded token stream read at a data position.

Checkpoints and resuming. Every ``--checkpoint-every`` steps the job writes
``<checkpoint-dir>/step_<N>/`` with ``zero3_compile.save_checkpoint``: the model and optimizer
shards, and each rank's step counter, LR scheduler state, data position and RNG states (torch CPU,
Python ``random``, CUDA when available), all sealed by one manifest of sha256 checksums and swapped
in atomically, so a step directory either is complete or does not exist. The last ``--keep`` are
kept. At start the job resumes from the newest checkpoint there; one whose files do not match
their checksums is refused (``z3.CheckpointCorruptError`` names the file) and the one before it is
used. When a rank dies, torchrun (``--max-restarts``) restarts every rank, they resume from the
newest checkpoint and replay the steps since: the same losses and bit-identical parameters as a
run that never failed (the stream is a function of ``--seed`` and the data position, the
compiled graphs are recompiled identically).

A dead rank never hangs the others. The bound is ``--timeout-s`` T (default 300 s; the tests use
20 s): every wait on another rank gives up after T, the process group's collectives
(``init_process_group(timeout=T)``) and zero3's cross-rank check before each compiled graph
(``shard(model, sync_timeout_s=T)``); keep T above the longest time one rank may legitimately
wait for another (the slowest rank's first compile, rank 0 writing a file). On any error this
script holds a roll call of ``ROLL_CALL_S`` (3 s) in the rendezvous store, prints the error and
"train.py: rank R stops: lost rank(s) [...]" naming the ranks that did not answer, and exits with
status 1 (through ``os._exit``: interpreter teardown with a broken process group can block);
torchrun then restarts the job, and without torchrun the job ends instead of hanging.

- A rank whose process dies (crash, SIGKILL, OOM kill): its sockets close and gloo fails the
  survivors' current or next collective at once, whether they are in forward or backward (the
  graph's all-gathers and reduce-scatters), the optimizer step (gradient clipping's all-reduce,
  or the next forward), a checkpoint save (``save_checkpoint`` raises ``PeerLostError`` naming
  the rank), or still compiling (the first graph's cross-rank check raises naming it). A
  survivor exits within the time to finish its current local work plus ~5 s (roll calls):
  measured 0.2 s (rank 0 lost: the store it hosts goes with it) to 7 s (death during compile),
  3.2 s in forward, backward and the optimizer step, 5.2 s during a save.
- A rank that hangs, or a host that vanishes without closing its connections: within T + 3 s
  (measured 13.0 s with T = 10 s for a rank stopped in backward).

The same on GPUs (NCCL): a dead peer does not reliably make an NCCL collective fail, so there the
process group timeout is the bound for a survivor blocked inside a collective:
``init_process_group("nccl", timeout=T)`` with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (the default)
or ``1`` (the NCCL watchdog ends the process, after aborting the communicators with 1, when a
collective has not completed within T; torchrun sees the exit and restarts the job); or
``TORCH_NCCL_BLOCKING_WAIT=1`` (the training thread waits on each collective and raises after T,
so this script's roll call names the lost rank; costs some overlap);
``TORCH_NCCL_ENABLE_MONITORING=1`` (default) with ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (default
480 s) kills a process whose watchdog itself hangs (e.g. in an NCCL abort); and
``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 records which
collective each rank was in. zero3's cross-rank check runs on a gloo side group with NCCL too, so
a survivor that reaches the next compiled graph names a dead peer at once.

Output: rank 0 prints the mean loss of each step; ``--log FILE`` gets one line per rank and step
(appended, for tests): ``rank 0 step 3 loss 3.1415926 restart 0 pid 1234``. Under torchrun spell
it ``--loss-log FILE`` (torchrun reads ``--log`` as an abbreviation of its ``--log-dir``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero3_compile as z3
from zero3_compile.runtime.guard import roll_call

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: gpt_model.py
from gpt_model import GPT, GPTConfig  # noqa: E402

ROLL_CALL_S = 3.0
SIZES = {
    "tiny": GPTConfig(),  # 2 layers, 20 wide: what the tests train
    "small": GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps in all")
    parser.add_argument("--checkpoint-dir", default=None, help="where step_<N>/ checkpoints go")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between saves")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept (newest)")
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log",
        "--loss-log",
        dest="log",
        default=None,
        help="file to append 'rank R step S loss L' lines to (under torchrun spell it "
        "--loss-log: torchrun takes --log for an abbreviation of its own --log-dir)",
    )
    parser.add_argument("--model", default="small", choices=sorted(SIZES))
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5, help="linear warmup steps")
    parser.add_argument(
        "--noise", type=float, default=0.1, help="largest share of input tokens randomised"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=300.0, help="longest wait on another rank"
    )
    parser.add_argument(
        "--final-state",
        default=None,
        help="full state dict saved at the end (default: <checkpoint-dir>/final_model.pt)",
    )
    args = parser.parse_args(argv)
    if args.final_state is None and args.checkpoint_dir:
        args.final_state = os.path.join(args.checkpoint_dir, "final_model.pt")
    return args


# ------------------------------------------------------------------------------------ data


class TokenStream:
    """An endless seeded stream of token sequences. Sample ``i`` depends on (seed, i) only, so the
    data position (samples consumed) is all a resumed run needs to continue the same stream."""

    def __init__(self, seed: int, vocab_size: int, length: int):
        self.seed, self.vocab_size, self.length = seed, vocab_size, length

    def sample(self, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = torch.randint(0, self.vocab_size, (1,), generator=gen)
        stride = torch.randint(1, 5, (1,), generator=gen)  # learnable: a modular progression
        return (start + stride * torch.arange(self.length + 1)) % self.vocab_size

    def batch(self, position: int, rank: int, world: int, per_rank: int):
        """This rank's part of the global batch that starts at ``position``."""
        first = position + rank * per_rank
        tokens = torch.stack([self.sample(first + j) for j in range(per_rank)])
        return tokens[:, :-1], tokens[:, 1:]


def corrupt(inputs: torch.Tensor, most: float, vocab_size: int) -> torch.Tensor:
    """Replace a random share (up to ``most``) of the input tokens: uses both global RNGs, which
    a resumed run must therefore restore."""
    share = most * random.random()
    mask = torch.rand(inputs.shape) < share
    return torch.where(mask, torch.randint_like(inputs, vocab_size), inputs)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


# ------------------------------------------------------------------------------ checkpoints


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(directory: str | None) -> list[tuple[int, str]]:
    """(step, path) of the checkpoints in ``directory``, newest first. Staging directories of
    interrupted saves (``step_N.tmp-*``) are not checkpoints; ``step_N.zero3-previous`` (a save
    that crashed between its two renames) is found by ``load_checkpoint`` under ``step_N``."""
    if not directory or not os.path.isdir(directory):
        return []
    found = {}
    for name in os.listdir(directory):
        match = re.fullmatch(r"step_(\d+)(\.zero3-previous)?", name)
        if match:
            found[int(match.group(1))] = os.path.join(directory, f"step_{match.group(1)}")
    return sorted(found.items(), reverse=True)


def resume(args, model, opt, sched, rank: int, world: int) -> tuple[int, int]:
    """Load the newest intact checkpoint; returns (step, data position), (0, 0) if none."""
    for _, path in checkpoints(args.checkpoint_dir):
        try:
            state = z3.load_checkpoint(path, model, opt)
        except z3.CheckpointCorruptError as error:  # raised on every rank alike
            if rank == 0:
                print(f"refusing {path}: {error}\n(trying the one before)", flush=True)
            continue
        if state is None:  # saved at another world size: shared state from rank 0, fresh RNGs
            state = z3.load_rank_state(path, 0)
            torch.manual_seed(args.seed + 1 + rank + 1_000_003 * state["step"])
            random.seed(args.seed + 1 + rank + 1_000_003 * state["step"])
        else:
            set_rng_state(state["rng"])
        sched.load_state_dict(state["scheduler"])
        if rank == 0:
            print(
                f"resumed from {path}: step {state['step']}, data position "
                f"{state['data_position']} (saved by {state['world_size']} ranks)",
                flush=True,
            )
        return state["step"], state["data_position"]
    return 0, 0


def save(args, model, opt, sched, step: int, position: int, rank: int, world: int) -> None:
    path = os.path.join(args.checkpoint_dir, f"step_{step:06d}")
    begin = time.perf_counter()
    state = {
        "step": step,
        "data_position": position,
        "scheduler": sched.state_dict(),
        "rng": rng_state(),
        "world_size": world,
    }
    z3.save_checkpoint(path, model, opt, rank_state=state)
    if rank == 0:
        for _, old in checkpoints(args.checkpoint_dir)[args.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        print(f"saved {path} in {time.perf_counter() - begin:.2f}s", flush=True)


# ------------------------------------------------------------------------------------ train


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    config = SIZES[args.model]
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = z3.shard(GPT(config).to(device), sync_timeout_s=args.timeout_s)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    step_model = torch.compile(model, backend="zero3", options={"codegen": args.codegen})
    torch.manual_seed(args.seed + 1 + rank)  # each rank's own noise
    random.seed(args.seed + 1 + rank)
    data = TokenStream(args.seed, config.vocab_size, config.block_size)

    start, position = resume(args, model, opt, sched, rank, world)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"GPT {params / 1e6:.2f}M parameters, {world} ranks, codegen={args.codegen}, "
            f"steps {start}..{args.steps - 1}, restart {restart}",
            flush=True,
        )
    for step in range(start, args.steps):
        begin = time.perf_counter()
        inputs, targets = data.batch(position, rank, world, args.batch_size)
        position += world * args.batch_size
        inputs = corrupt(inputs, args.noise, config.vocab_size).to(device)
        targets = targets.to(device)
        logits = step_model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if args.log:
            with open(args.log, "a") as f:
                f.write(
                    f"rank {rank} step {step} loss {loss.item()!r} restart {restart} "
                    f"pid {os.getpid()}\n"
                )
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(
                f"step {step}: loss {mean.item() / world:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                f"{(time.perf_counter() - begin) * 1e3:.1f} ms",
                flush=True,
            )
        done = step + 1
        if args.checkpoint_dir and args.checkpoint_every and done % args.checkpoint_every == 0:
            save(args, model, opt, sched, done, position, rank, world)
    if args.final_state:
        z3.save_full_state_dict(args.final_state, model)


# ---------------------------------------------------------------------------- lost ranks


def lost_ranks(store: dist.Store, rank: int, world: int) -> tuple[list[int], str]:
    """After an error: the ranks that do not answer a roll call in the store within
    ``ROLL_CALL_S``, and how they were found. Every survivor of a lost rank fails within moments
    of the others, so they all answer; the first verdict reached is kept, so survivors that failed
    later only because an earlier one already exited name the same ranks. ([], ...): every rank
    answered."""
    prefix = "train/rollcall/"
    try:
        alive = roll_call(prefix, range(world), ROLL_CALL_S, store)
        if alive is None:
            raise ConnectionError("the store is unreachable")
        if len(alive) == world:
            return [], "every rank answered"
        mine = sorted(set(range(world)) - alive)
        verdict = store.compare_set(prefix + "verdict", "", repr(mine)).decode()
        lost = [int(r) for r in re.findall(r"\d+", verdict)]
        return lost, f"no answer to a roll call within {ROLL_CALL_S:.0f}s"
    except Exception:  # noqa: BLE001
        if rank == 0:
            return [], "the store is unreachable"
        # without torchrun, rank 0 hosts the rendezvous store (torchrun's agent hosts it otherwise)
        return [0], "the rendezvous store it hosts is gone"


def fail(error: BaseException, store: dist.Store, rank: int, world: int) -> None:
    traceback.print_exception(error)
    lost, how = lost_ranks(store, rank, world) if world > 1 else ([], "")
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    cause = f"{type(error).__name__}: {text if len(text) <= 200 else text[:200] + '...'}"
    if lost:
        print(
            f"train.py: rank {rank} stops: lost rank(s) {lost} ({how}; this rank's error: "
            f"{cause}). torchrun --max-restarts restarts the job from the newest checkpoint.",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"train.py: rank {rank} stops: {cause}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=args.timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun's agent keeps one store across restarts: without a prefix per attempt, a restarted
    # rank can read a dead rank's address from the previous attempt and fail to connect
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"train/attempt_{attempt}", store)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        train(args, rank, world)
    except BaseException as error:  # noqa: BLE001  - every failure ends the process, named
        fail(error, store, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
