"""``Meeting``: named points in the rendezvous store where every rank learns at once that one
rank failed, instead of the others waiting in a collective.

A step can fail on one rank only (its rows of a damaged file, its own disk), anywhere inside
code that is not ours. Around such steps the ranks meet at numbered points in the store: each
rank posts "arrived" (or, from an ``except`` handler, "failed" with its error) and waits until
every rank arrived or one failed; a failure anywhere raises ``RankFailedError`` on every rank,
naming the rank and its error. A rank that neither arrives nor fails within the timeout is named
as missing.

Leaving a meeting is a second handshake: the store lives in one rank's process (rank 0 under
``env://``), so a rank that saw everyone arrive and then exited could close the store under a
peer still reading the last "arrived" keys. Each rank counts itself out once it saw every rank
arrive, and rank 0 leaves last, when every rank counted itself out (the others' last store call,
the count, has then been answered).
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

from .._torch.c10d import default_store
from .failures import Failure, RankFailedError

POLL_S = 0.05
LEAVE_TIMEOUT_S = 60.0  # rank 0 waits this long at most for the others to count themselves out
_REASON_CHARS = 2000  # of a failure's text posted in the store
_calls = itertools.count()


class Meeting:
    """The meeting points of one collective operation (``what``) on every rank of ``ranks``
    (default: all); every rank creates its meetings in the same order.

    Example:
        ```python
        meeting = Meeting("loading the weights", timeout_s=600)
        try:
            read_my_rows()
        except BaseException as error:
            meeting.fail(error)  # the others raise RankFailedError at their next meet()
            raise
        meeting.meet("reading the rows")
        ```
    """

    def __init__(
        self,
        what: str,
        ranks: list[int] | None = None,
        timeout_s: float = 600.0,
        *,
        poll_s: float = POLL_S,
    ):
        self.what = what
        self.ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.store = default_store()
        # every rank creates its meetings in the same order: the same prefix everywhere
        self.prefix = f"zero3/agree/{next(_calls)}/"
        self.stage = 0
        self.failed = False

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{self.stage}/{kind}/{rank}"

    def meet(self, step: str) -> None:
        """Wait until every rank finished ``step``; raise ``RankFailedError`` if one failed."""
        if self.store is None or len(self.ranks) == 1:
            return
        me = dist.get_rank()
        self.store.set(self._key("arrived", me), "1")
        deadline = time.monotonic() + self.timeout_s
        pending = set(self.ranks)
        while True:
            for rank in list(pending):
                if self.store.check([self._key("failed", rank)]):
                    reason = self.store.get(self._key("failed", rank)).decode()
                    raise RankFailedError(
                        f"zero3: {self.what} failed on rank {rank} while {step}: {reason}",
                        failures=[Failure(rank, reason)],
                    )
                if self.store.check([self._key("arrived", rank)]):
                    pending.discard(rank)
            if not pending:
                break
            if time.monotonic() > deadline:
                missing = sorted(pending)
                raise RankFailedError(
                    f"zero3: {self.what}: rank(s) {missing} did not finish {step} within "
                    f"{self.timeout_s:.0f}s (dead, stuck, or not running this call)",
                    failures=[Failure(rank, f"did not finish {step}") for rank in missing],
                )
            time.sleep(self.poll_s)
        self._leave(me)
        self.stage += 1

    def _leave(self, me: int) -> None:
        # the step succeeded everywhere: a peer that dies now is not this step's failure, so rank
        # 0 stops waiting after a while instead of raising
        left = self.store.add(f"{self.prefix}{self.stage}/left", 1)
        if me != 0 or 0 not in self.ranks:
            return
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while left < len(self.ranks) and time.monotonic() < deadline:
            time.sleep(self.poll_s)
            left = self.store.add(f"{self.prefix}{self.stage}/left", 0)

    def fail(self, error: BaseException) -> None:
        """From an ``except`` handler: tell the other ranks (once); the caller re-raises."""
        if self.store is None or self.failed or isinstance(error, RankFailedError):
            return
        self.failed = True
        reason = Failure.of(dist.get_rank(), error).reason.strip()[:_REASON_CHARS]
        try:
            self.store.set(self._key("failed", dist.get_rank()), reason)
        except Exception:  # noqa: BLE001 - the store itself is gone: the peers time out
            pass
