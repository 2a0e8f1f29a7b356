"""A rank lost during a collective checkpoint call: ``PeerLostError`` on the others.

When a rank dies during a save or a load, the others' next exchange fails (gloo raises at once
when the dead process's connections close; otherwise the process group's timeout bounds the
wait); they then hold a roll call in the store (``cluster.lost_ranks``) and raise
``PeerLostError`` naming the ranks that did not answer within ``ROLL_CALL_S`` seconds.
"""

from __future__ import annotations

import torch.distributed as dist

from ...cluster import lost_ranks
from .manifest import CheckpointCorruptError

ROLL_CALL_S = 2.0  # how long survivors of a failed collective wait for each other's answer
_calls = 0


class PeerLostError(RuntimeError):
    """A rank died or stopped answering during a collective checkpoint call (raised on the
    others); ``lost`` lists the ranks that did not answer.

    Example:
        ```python
        try:
            z3.save_checkpoint("ckpt/step_100", model, opt)
        except z3.PeerLostError as error:
            print("lost ranks", error.lost)  # exit; torchrun --max-restarts restarts the job
        ```
    """

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#peerlosterror)"

    def __init__(self, message: str, *, lost=()):
        super().__init__(message)
        self.lost = list(lost)


def next_call(kind: str) -> str:
    """A name every rank gives the same collective checkpoint call (they call them in order)."""
    global _calls
    _calls += 1
    return f"{kind}{_calls}"


def raise_if_peer_lost(error: BaseException, call: str, what: str, note: str) -> None:
    """After ``error`` ended the collective call ``call`` (``next_call``): ``PeerLostError`` if
    ranks do not answer a roll call, else nothing (the caller re-raises ``error``)."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, CheckpointCorruptError)):
        return
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # every survivor fails at the same exchange: the living answer the roll call at once
    prefix = f"zero3/checkpoint/{call}/rollcall/"
    lost = lost_ranks(prefix, range(dist.get_world_size()), ROLL_CALL_S)
    if not lost:
        return
    cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
    raise PeerLostError(
        f"zero3: {what} on rank {dist.get_rank()}: lost rank(s) {lost}: they did not answer "
        f"within {ROLL_CALL_S:.0f}s after the collective failed ({type(error).__name__}: "
        f"{cause}). {note}",
        lost=lost,
    ) from error
