"""Optimizer steps taken during the backward: ``offload_optimizer(..., in_backward=True)``.

```python
model = z3.shard(model, offload=z3.Offload(params="disk", grads="disk", path=p))
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), path=p, in_backward=True)
loss.backward()   # each parameter steps as soon as its gradient is reduced
opt.step()        # waits for the last of them and makes the new state current
opt.zero_grad()
```
With parameters and optimizer state on disk a step is mostly I/O: every parameter's shard and
moments read and written back. ``step()`` after the backward runs that I/O after the compute;
here it runs beside the backward. Each reduced gradient shard (``zero3::spool_grad``, right
after its bucket's copy-out) goes to a stepping thread instead of the gradient spool: it reads
the parameter's state, steps it and the shard as a parameter of their own with its group's
hyperparameters (pieces of ``tile_mb`` for large ones, like ``step()``), and writes them to the
stores' free slots. The shard's values are those the backward graph reloaded for its gather,
kept for the step (``zero3::reload(..., last=True)``: the step would read them again right
after; the kept copy lives until its gradient comes, normally a bucket later); a parameter the
backward does not gather (its gradient needs no values: a bias, an embedding) reads its shard.
``step()`` waits for the steps still running and commits every region; until then the previous
values stay current, so a refusal undoes the whole backward's steps (with
``double_buffer=False`` there is one copy: the values are lost and reads raise, as after a failed
``step()``). The results are the bits of ``offload_optimizer`` without it.

A gradient the step already consumed cannot be used for anything else, so this mode refuses, by
name, what needs the gradients after the backward: ``param.grad`` is a placeholder that knows
its 2-norm (taken with the gradient, as the spool computes one: ``clip_grad_norm_`` reads it
without the values, and a clip that changes nothing, its norm under the bound or no bound as the
Hugging Face Trainer logs it, passes), but whose every read, scaling (a clip that would scale,
``GradScaler.unscale_``), accumulation (a second backward before ``step()``, gradient sync
turned off), and a learning rate or other hyperparameter changed between the backward and
``step()`` raise and undo the backward's steps. ``z3hf.Trainer`` refuses the arguments that
need them before the first step (``max_grad_norm`` > 0, gradient accumulation, fp16).
Gradients that did not come through the backward's reduction (eager code the model's graphs
do not cover) and those of tied parameters (an embedding tied to the output head: its gradient
comes in parts, one per use) are spooled and step in ``step()`` as usual.

It needs parameters and gradients offloaded (``Offload(params=..., grads=...)``: the gradient
leaves the backward where the spool would take it, and the parameter's new values must not be
current before ``step()``) and an optimizer whose update of an element reads only that element
(``SGD``, ``Adam``, ``AdamW``, ...: each parameter steps on its own, on this rank's shard).
"""

from __future__ import annotations

import threading
import time

import torch

from ...sharding.state import ShardState, state_of
from ..grads import Applied, SpooledGrad, spooled
from .tiled import OptimizerOffload
from .tiles import ELEMENTWISE, Feed, Piece, Undo, local_of

# gradient bytes handed to the stepping thread and not stepped yet before the backward waits
# (the reloaded shard values that go with them hold as much again)
QUEUED_BYTES = 256 * 2**20
# reloaded shard values kept for steps whose gradients did not come yet (normally a bucket or
# two: each is taken with its gradient); beyond it the oldest go, and their steps read again
KEPT_BYTES = 2**30


def check_setup(optimizer, states: dict) -> None:
    """Refuse what the in-backward mode cannot run, naming the fix."""
    if type(optimizer) not in ELEMENTWISE:
        known = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise ValueError(
            f"zero3: offload_optimizer(in_backward=True) steps each parameter's shard on its own "
            f"while the backward runs; it needs an optimizer whose update of an element reads "
            f"only that element ({known}), not {type(optimizer).__name__}. Use in_backward=False."
        )
    for param, state in states.items():
        if state is None:
            raise ValueError(
                "zero3: offload_optimizer(in_backward=True) needs every parameter sharded by "
                f"zero3.shard; a parameter of shape {tuple(param.shape)} is not"
            )
        if state.offload is None or getattr(state.root, "grad_spool", None) is None:
            raise ValueError(
                "zero3: offload_optimizer(in_backward=True) needs parameters and gradients "
                "offloaded: shard the model with offload=Offload(params='disk', grads='disk') "
                f"(parameter {state.spec.fqn!r} has "
                f"{'no offloaded shard' if state.offload is None else 'no gradient spool'})"
            )


class InBackward:
    """The steps one optimizer takes during backward passes (see the module docstring)."""

    def __init__(self, offload: OptimizerOffload, queued_bytes: int = QUEUED_BYTES):
        self.offload = offload
        self.queued_bytes = queued_bytes
        self.window: _Window | None = None  # the steps since the last ``step()``
        self.windows = 0  # backward windows committed
        self.stepped_in_backward = 0  # parameters stepped during a backward, over all windows
        self.stepped_after = 0  # parameters with gradients from elsewhere, stepped in step()
        self.reused_bytes = 0  # shard bytes stepped from the backward's reloads, not read again
        # seconds the training thread waited for the stepping thread (the backward when more
        # than ``queued_bytes`` of gradients wait, step() for the last steps), and seconds the
        # stepping thread waited for its reads and writes (hidden when the backward computes)
        self.waited_s = 0.0
        self.stepper_waited_s = 0.0

    def take(self, state, grad: torch.Tensor) -> torch.Tensor:
        """``zero3::spool_grad``'s body for this optimizer's parameters (the backward's
        thread): hand the reduced gradient shard to the stepping thread."""
        return self._open().take(state, grad)

    def keep(self, state, values: torch.Tensor) -> None:
        """``params.reload_async``'s keeper (the backward's thread): a backward graph read the
        parameter's shard for its gather; its step uses these values instead of reading them
        again."""
        self._open().keep(state, values)

    def _open(self) -> _Window:
        """The window of this backward, opened by its first reload or gradient."""
        if self.window is None:
            self.window = _Window(self)
        return self.window

    def step(self) -> None:
        window, self.window = self.window, None
        offload = self.offload
        optimizer = offload.optimizer
        owned = window.params if window is not None else []
        if window is not None:
            window.finish()
        rest = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and (window is None or id(p) not in window.taken)
        ]
        try:
            if rest:  # gradients that came another way: stepped now, committed with the others
                offload.step(rest, commit=False)
        except BaseException:
            if window is not None:
                window.undo()
            raise
        offload.commit(owned + rest)
        self.stepped_after += len(rest)
        if window is not None:
            window.committed = True
            self.windows += 1
            self.stepped_in_backward += len(owned)


class _GradFeed(Feed):
    """A feed whose pieces hold the backward's gradients: the backward waits while more than
    ``limit`` bytes of them wait to be stepped."""

    def __init__(self, slots: int, limit: int):
        super().__init__(slots)
        self.limit = limit
        self.queued = 0
        self.failed = False

    def reserve(self, nbytes: int) -> float:
        """Room for ``nbytes`` more; returns the seconds the caller waited for it."""
        started = time.perf_counter()
        with self.cond:
            while self.queued and self.queued + nbytes > self.limit and not self.failed:
                self.cond.wait()
            self.queued += nbytes
        return time.perf_counter() - started

    def stepped(self, tile: list) -> None:
        piece = tile[0]
        if piece.last:
            with self.cond:
                self.queued -= _nbytes(piece.given)
                self.cond.notify_all()
        piece.given = piece.values = None

    def get(self, i: int) -> list | None:
        with self.cond:
            return None if self.failed else super().get(i)

    def fail(self) -> None:
        """No more tiles: the stepping thread failed, or the window was refused."""
        with self.cond:
            self.failed = True
            self.closed = True
            self.cond.notify_all()


class _Taken(Applied):
    """What ``param.grad`` holds for a gradient a window stepped with: its 2-norm, and the
    window's rules for anything else."""

    def __init__(self, window: _Window, norm: torch.Tensor):
        self.window = window
        self.norm = norm

    def check(self, what: str) -> None:
        self.window.check(what)


class _Window:
    """The steps taken in the backward passes between two ``step()`` calls (one backward: a
    second one is refused)."""

    def __init__(self, owner: InBackward):
        self.owner = owner
        offload = owner.offload
        optimizer = offload.optimizer
        self.undo_record = Undo(optimizer, [])
        self.started: dict[int, dict] = {}
        self.taken: dict[int, torch.Tensor] = {}
        self.kept: dict[int, torch.Tensor] = {}  # id(param) -> its reloaded values, not taken yet
        self.hyperparameters = _hyperparameters(optimizer)
        self.committed = False
        self.refused: str | None = None
        self.error: BaseException | None = None
        self.feed = _GradFeed(offload.slots, owner.queued_bytes)
        every = [p for g in optimizer.param_groups for p in g["params"]]
        states = {id(p): optimizer.state.get(p, {}) for p in every}
        pieces = [[piece] for p in every for piece in _pieces(offload, p)]
        offload.pool = offload.staging_pool(pieces, states)
        self.thread = threading.Thread(target=self._run, name="zero3-opt-backward", daemon=True)
        self.thread.start()

    @property
    def params(self) -> list:
        return list(self.taken.values())

    # ------------------------------------------------------------------ the backward's side

    def keep(self, state, values: torch.Tensor) -> None:
        param = state.param
        if self.refused is not None or id(param) in self.taken or not param.requires_grad:
            return
        self.kept.pop(id(param), None)  # a later reload of the same values: the newest stays
        self.kept[id(param)] = values
        while sum(map(_nbytes, self.kept.values())) > KEPT_BYTES:
            self.kept.pop(next(iter(self.kept)))

    def take(self, state, grad: torch.Tensor) -> torch.Tensor:
        param = state.param
        offload = self.owner.offload
        if id(param) in self.taken:
            self._refuse(
                f"parameter {state.spec.fqn!r} received a second gradient before step(): its "
                "first one was stepped already (a second backward, or the parameter used in two "
                "compiled graphs whose gradients autograd adds)"
            )
        reason = _accumulating(state, param)
        if reason is not None:
            self._refuse(reason)
        grad = grad.detach()
        self.undo_record.add(offload.optimizer, [param])
        self.started[id(param)] = dict(offload.optimizer.state.get(param, {}))
        self.taken[id(param)] = param
        pieces = _pieces(offload, param)
        values = self.kept.pop(id(param), None)  # the backward's reload: not read again
        self.owner.reused_bytes += _nbytes(values)
        for piece in pieces:
            piece.given, piece.values = grad, values
        self._waited(self.feed.reserve(_nbytes(grad)))
        self.feed.append([[piece] for piece in pieces])
        # its 2-norm, as the spool computes one for each gradient it writes: a norm is read
        # without the values (clip_grad_norm_, the Trainer's logged grad_norm)
        taken = _Taken(self, torch.linalg.vector_norm(grad, 2.0))
        return SpooledGrad.holding(state.root.grad_spool, taken, grad)

    # ------------------------------------------------------------------ the stepping thread

    def _waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for the stepping thread."""
        self.owner.waited_s += seconds
        self.owner.offload.store.count_wait(seconds)

    def _stepper_waited(self, seconds: float) -> None:
        self.owner.stepper_waited_s += seconds

    def _run(self) -> None:
        try:
            self.owner.offload.run(self.feed, self.started, self._stepper_waited)
        except BaseException as error:  # noqa: BLE001 - raised by step()
            self.error = error
            self.feed.fail()

    def finish(self) -> None:
        """Wait for every step taken; raise (after undoing them all) what failed or changed."""
        self.feed.close()
        started = time.perf_counter()
        self.thread.join()
        self._waited(time.perf_counter() - started)
        self.owner.offload.pool = None
        self.kept.clear()  # reloaded, no gradient came (the step reads them as usual)
        if self.error is not None:
            self.undo()
            raise self.error
        if self.refused is not None:
            self.check("stepped")
        changed = _changed(self.hyperparameters, _hyperparameters(self.owner.offload.optimizer))
        if changed:
            self._refuse(
                f"the optimizer's {changed} changed between the backward and step(); the "
                "backward stepped with the values it had then. Change hyperparameters (a "
                "scheduler's step()) after optimizer.step()"
            )
        for param in self.taken.values():
            grad = spooled(param)
            if grad is None or not (
                isinstance(grad.content, _Taken) and grad.content.window is self
            ):
                self._refuse(
                    "a gradient the backward stepped with was dropped or replaced before step() "
                    "(zero_grad() between backward() and step()?)"
                )

    def undo(self) -> None:
        self.owner.offload.undo(self.undo_record)

    # ------------------------------------------------------------------ param.grad's rules

    def check(self, what: str) -> None:
        if self.committed and what == "zeroed":  # zero_grad(set_to_none=False) after step()
            return
        if self.committed:
            raise RuntimeError(
                f"zero3: this gradient cannot be {what}: offload_optimizer(in_backward=True) "
                "applied it to its parameter during the backward. Zero the gradients "
                "(optimizer.zero_grad()) before the next backward; to read, scale or clip "
                "gradients use in_backward=False"
            )
        if self.refused is not None:
            raise RuntimeError(f"zero3: {self.refused}")
        self._refuse(
            f"a gradient was {what} between the backward and step(), but "
            "offload_optimizer(in_backward=True) stepped each parameter with its gradient "
            "during the backward (clip_grad_norm_, GradScaler and gradient accumulation need "
            "the gradients first)"
        )

    def _refuse(self, reason: str):
        """Undo every step of this window and raise ``reason`` (later uses of its gradients
        raise it again; the next backward starts a new window)."""
        if self.refused is None:
            self.feed.fail()  # the steps not started yet are not taken
            self.thread.join()
            self.owner.offload.pool = None
            self.kept.clear()
            self.undo()
            stores = [self.owner.offload.store]
            stores += [state_of(p).offload.store for p in self.taken.values()]
            lost = any(getattr(store, "slots", 2) == 1 for store in stores)
            outcome = (
                "the steps it took are lost (double_buffer=False keeps one copy): load a checkpoint"
                if lost
                else "the steps it took were undone"
            )
            self.refused = (
                f"{reason}; {outcome}. Use offload_optimizer(in_backward=False) for this loop."
            )
            if self.owner.window is self:
                self.owner.window = None
        raise RuntimeError(f"zero3: {self.refused}")


def _pieces(offload: OptimizerOffload, param) -> list[Piece]:
    local = local_of(param)
    pieces = offload.pieces(param, offload.nbytes(param))
    return pieces or [Piece(param, 0, local.numel(), True)]


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _accumulating(state, param) -> str | None:
    """Why ``param``'s gradient of this backward would not be its whole gradient, or None."""
    if state.state is not ShardState.SHARDED or (
        state.grad_sink is not None and state.grad_sink.grad is not None
    ):
        return (
            f"parameter {state.spec.fqn!r} has gradients accumulated with gradient sync off; "
            "the backward would step with the last micro-batch's alone"
        )
    grad = spooled(param)
    if param.grad is None or (grad is not None and grad.content is None):
        return None  # none, or zeros (zero_grad(set_to_none=False))
    return (
        f"parameter {state.spec.fqn!r} still has a gradient from an earlier backward; "
        "zero the gradients (optimizer.zero_grad()) after each step"
    )


def _hyperparameters(optimizer) -> list[dict]:
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def _changed(before: list[dict], after: list[dict]) -> str | None:
    """The name of a hyperparameter that differs, or None."""
    for old, new in zip(before, after):
        for key in old.keys() | new.keys():
            a, b = old.get(key), new.get(key)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                same = same and a.shape == b.shape and bool(torch.equal(a, b))
            else:
                same = a == b
            if not same:
                return repr(key)
    return None
