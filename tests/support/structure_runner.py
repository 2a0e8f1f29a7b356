"""Train a sharded model beside its single-process eager twin and report every difference.

``train_and_compare`` runs on each rank: the sharded model (compiled with the zero3 backend, or
eager) trains on the rank's share of each micro-batch, the unsharded reference on all shares
(the per-share losses averaged over ranks, as data parallelism averages gradients); losses,
gradients (``None`` exactly where eager has ``None``), the non-tensor parts of the outputs and
the final parameters are compared. The regression tests (``test_structure_regressions.py``)
use it directly.

The structure fuzzer runs its cases (``structure_cases.py``) through ``CaseRunner``: one
``RankPool`` per world size, ranks started once and kept for case after case (``run_case`` on
every rank: dynamo reset, the case built from its source, checked in eager, then trained).
"""

from __future__ import annotations

import copy
import os
import queue
import resource
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import zero3_compile as z3

from . import dist_utils
from .structure_cases import Case, batches, build

# relative error (max |a - b| / max |b|) allowed per tensor, by codegen (None: not compiled)
TOLERANCE = {None: 1e-5, "eager": 1e-5, "inductor": 1e-4}

# batch(step, micro, rank) -> (forward arguments, target)
Batch = Callable[[int, int, int], tuple[tuple, torch.Tensor]]


@dataclass(frozen=True)
class Training:
    """How to train: the backend's options (None: uncompiled), the optimizer, steps, micro-batches."""

    options: dict[str, Any] | None = None
    optimizer: str = "sgd"
    steps: int = 2
    micro_batches: int = 1
    # micro-batches before the last run with gradient sync off (False: plain accumulation,
    # every backward reduces); keep_gathered: set_requires_gradient_sync's
    sync_off: bool = True
    keep_gathered: bool = False
    inference: bool = False  # after training, compare a forward under no_grad too

    @property
    def codegen(self) -> str | None:
        return None if self.options is None else self.options.get("codegen", "inductor")


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        # eps large enough that a gradient of rounding noise (1e-9 here, 0 there) moves nothing
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / (scale if scale > 0 else 1.0)


def skeleton(out: Any) -> Any:
    """The output's structure with each tensor replaced by its shape (what must match exactly)."""
    if isinstance(out, torch.Tensor):
        return ("tensor", tuple(out.shape), out.dtype)
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, [skeleton(o) for o in out])
    if isinstance(out, dict):
        return ("dict", [(k, skeleton(v)) for k, v in out.items()])
    return out


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensor_leaves(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensor_leaves(o)]
    return []


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    grads = {}
    for name, param in model.named_parameters():  # same order on every rank: gathers pair up
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().clone()
    return grads


def _mean_over_ranks(value: float) -> float:
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_and_compare(
    rank: int,
    world: int,
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batch: Batch,
    training: Training,
    sync_timeout_s: float = 120.0,
) -> list[str]:
    """Train ``model`` sharded and a deep copy of it unsharded; returns the differences found
    (empty: equivalent). Exceptions propagate."""
    reference = copy.deepcopy(model)
    z3.shard(model, sync_timeout_s=sync_timeout_s)
    step_model = model
    if training.options is not None:
        step_model = torch.compile(model, backend="zero3", options=training.options)
    opt = make_optimizer(training.optimizer, model.parameters())
    ref_opt = make_optimizer(training.optimizer, reference.parameters())
    tol = TOLERANCE[training.codegen]
    micro_batches = training.micro_batches
    problems: list[str] = []
    for step in range(training.steps):
        loss_sum, ref_loss_sum = 0.0, 0.0
        for micro in range(micro_batches):
            if micro_batches > 1 and training.sync_off:
                sync = micro == micro_batches - 1
                keep = training.keep_gathered and not sync
                z3.set_requires_gradient_sync(model, sync, keep_gathered=keep)
            args, target = batch(step, micro, rank)
            out = step_model(*args)
            loss = loss_fn(out, target) / micro_batches
            loss.backward()
            loss_sum += loss.item()
            with torch.no_grad():
                ref_out = reference(*args)
            if skeleton(out) != skeleton(ref_out):
                problems.append(
                    f"step {step} micro {micro}: output {skeleton(out)} != eager {skeleton(ref_out)}"
                )
            for r in range(world):
                r_args, r_target = batch(step, micro, r)
                ref_loss = loss_fn(reference(*r_args), r_target) / (micro_batches * world)
                ref_loss.backward()
                ref_loss_sum += ref_loss.item()
        got_loss = _mean_over_ranks(loss_sum)
        if abs(got_loss - ref_loss_sum) > tol * max(abs(ref_loss_sum), 1e-3):
            problems.append(f"step {step}: loss {got_loss!r} != eager {ref_loss_sum!r}")
        grads, ref_grads = _full_grads(model), _full_grads(reference)
        for name, want in ref_grads.items():
            got = grads.get(name)
            if (got is None) != (want is None):
                state = lambda g: "None" if g is None else "a tensor"  # noqa: E731
                problems.append(f"step {step}: {name}.grad is {state(got)}, eager {state(want)}")
            elif want is not None and rel_diff(got, want) > tol:
                problems.append(f"step {step}: {name}.grad off by {rel_diff(got, want):.2e}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    params = z3.full_state_dict(model)
    for name, want in reference.state_dict().items():
        got = params.get(name)
        if got is None:
            problems.append(f"final state: {name} missing")
        elif rel_diff(got, want) > tol:
            problems.append(f"final state: {name} off by {rel_diff(got, want):.2e}")
    if training.inference:
        args, _ = batch(training.steps, 0, rank)
        with torch.no_grad():
            outs, ref_outs = tensor_leaves(step_model(*args)), tensor_leaves(reference(*args))
        for k, (got, want) in enumerate(zip(outs, ref_outs)):
            if rel_diff(got, want) > tol:
                problems.append(f"inference: output {k} off by {rel_diff(got, want):.2e}")
    return problems


# ----------------------------------------------------------------------------- a pool of ranks


class RankFailure(RuntimeError):
    """A rank died, hung past the timeout, or its call raised outside the called function."""


def _serve(rank: int, world: int, inbox, outbox) -> None:
    """A rank's loop: run each ``(seq, fn, args)`` from ``inbox``, report to ``outbox``."""
    while True:
        item = inbox.get()
        if item is None:
            return None
        seq, fn, args = item
        try:
            outbox.put((seq, rank, "ok", fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 (reported; the driver restarts the ranks)
            outbox.put((seq, rank, "error", traceback.format_exc()))


class RankPool:
    """``world`` gloo ranks started once and kept for many calls (a launch costs seconds).

    ``call(fn, *args)`` runs ``fn(rank, world, *args)`` on every rank and returns the results
    by rank. A rank that dies, raises, or does not answer within ``timeout`` seconds gets every
    rank killed (a fresh group starts on the next call) and raises ``RankFailure``. Ranks start
    the way ``dist_utils.run_ranks`` starts them (its fork server, with the imports preloaded,
    and its worker), but run ``_serve``: calls come through a queue instead of one at launch.
    """

    def __init__(self, world: int):
        self.world = world
        self.procs: list = []
        self.launches = 0
        self._seq = 0

    def _start(self) -> None:
        ctx = dist_utils._forkserver()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.reports = ctx.Queue()  # what _worker reports when _serve returns or raises
        env = {**os.environ, **dist_utils.RANK_ENV}
        port = dist_utils.free_port()
        self.procs = [
            ctx.Process(
                target=dist_utils._worker,
                args=(
                    _serve,
                    rank,
                    self.world,
                    port,
                    self.reports,
                    (self.inboxes[rank], self.outbox),
                    env,
                ),
            )
            for rank in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self.launches += 1

    def call(
        self,
        fn: Callable,
        *args: Any,
        timeout: float = 300.0,
        failed: Callable[[Any], bool] | None = None,
    ) -> list[Any]:
        """``failed(result)``: a rank's result that means the others may never answer (they
        wait in a collective it left): they then get 30 s more, not the whole ``timeout``."""
        if not self.procs:
            self._start()
        self._seq += 1
        for inbox in self.inboxes:
            inbox.put((self._seq, fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            try:
                seq, rank, status, value = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    why = f"rank(s) {dead} died" if dead else f"no answer within {timeout:.0f}s"
                    raise RankFailure(f"{why} (answered: {sorted(results)})") from None
                continue
            if seq != self._seq:
                continue
            if status == "error":
                self.close(kill=True)
                raise RankFailure(f"rank {rank} raised:\n{value}")
            results[rank] = value
            if failed is not None and failed(value):
                deadline = min(deadline, time.monotonic() + 30.0)
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not self.procs:
            return
        if not kill:
            for inbox in self.inboxes:
                inbox.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []


# ----------------------------------------------------------------------------- fuzz cases


def _check_valid(namespace, case: Case, batch) -> None:
    """Eager, unsharded: one forward and backward per batch shape (raises if the case itself
    is broken: what eager refuses is not the fuzzer's business)."""
    torch.manual_seed(case.seed)
    model = namespace["Model"]()
    for step in range(min(case.steps, 2)):
        args, target = batch(step, 0, 0)
        loss = namespace["loss_fn"](model(*args), target)
        loss.backward()


def run_case(rank: int, world: int, case_json: str) -> dict[str, Any]:
    """Train one case on this rank against eager; ``{"status": "ok" | "mismatch" | "error" |
    "invalid", "detail": ...}``."""
    started = _cpu_seconds()
    case = Case.from_json(case_json)
    torch._dynamo.reset()
    namespace = build(case)
    batch = batches(case)
    try:
        _check_valid(namespace, case, batch)
    except Exception as error:  # noqa: BLE001
        return {"status": "invalid", "detail": f"{type(error).__name__}: {error}"}
    torch.manual_seed(case.seed)
    model = namespace["Model"]()
    training = Training(
        options=dict(case.options),
        optimizer=case.optimizer,
        steps=case.steps,
        micro_batches=case.micro_batches,
        sync_off=not case.plain_accumulation,
        keep_gathered=case.keep_gathered,
        inference=case.inference,
    )
    try:
        problems = train_and_compare(
            rank, world, model, namespace["loss_fn"], batch, training, sync_timeout_s=60
        )
    except Exception as error:  # noqa: BLE001
        return {
            "status": "error",
            "detail": f"{type(error).__name__}: {_first_line(error)}",
            "traceback": traceback.format_exc(),
            "cpu_s": _cpu_seconds() - started,
        }
    finally:
        torch._dynamo.reset()
    status = "mismatch" if problems else "ok"
    # CPU seconds of this rank: what the case costs on an idle machine, whatever the load now
    return {"status": status, "detail": problems, "cpu_s": _cpu_seconds() - started}


def _cpu_seconds() -> float:
    """CPU seconds of this rank and the processes it waited for (Inductor's C++ compiler)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from every rank's: the worst status, the first rank's detail of it, and the
    CPU seconds of every rank."""
    cpu = [r.get("cpu_s", 0.0) for r in per_rank]
    for status in ("error", "mismatch", "invalid", "ok"):
        hit = [r for r in per_rank if r["status"] == status]
        if hit:
            return {**hit[0], "cpu_s": cpu}
    raise AssertionError(per_rank)


def timeout_of(case: Case) -> float:
    """Seconds a case may take before its ranks count as hung (a shared 2-core machine)."""
    return 900.0 if case.codegen == "inductor" else 240.0


class CaseRunner:
    """Runs cases on a pool of ranks per world size, one process launch per world size unless a
    case fails (its ranks are then restarted: a failed case can leave a collective unmatched)."""

    def __init__(self):
        self.pools: dict[int, RankPool] = {}

    def __call__(self, case: Case) -> dict[str, Any]:
        pool = self.pools.get(case.world)
        if pool is None:
            pool = self.pools[case.world] = RankPool(case.world)
        try:
            per_rank = pool.call(
                run_case,
                case.to_json(),
                timeout=timeout_of(case),
                failed=lambda r: r["status"] == "error",
            )
            result = combine(per_rank)
        except RankFailure as failure:
            return {
                "status": "error",
                "detail": f"RankFailure: {_first_line(failure)}",
                "traceback": str(failure),
            }
        if result["status"] == "error":
            pool.close(kill=True)
        return result

    @property
    def launches(self) -> int:
        return sum(p.launches for p in self.pools.values())

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def signature(result: dict[str, Any]) -> str:
    """What kind of failure a result is, for keeping a shrunk case failing the same way."""
    if result["status"] == "error":
        return "error: " + result["detail"].split(":")[0]
    return result["status"]
