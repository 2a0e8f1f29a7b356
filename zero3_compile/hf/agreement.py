"""Every rank learns at once when one rank failed, instead of the others waiting in a collective.

A loading or saving step can fail on one rank only (its rows of a damaged file, its own disk).
Around such steps the ranks meet at named points in the store: each rank posts "arrived" (or, from
an ``except`` handler, "failed" with the error), and waits until every rank arrived or one failed;
a failure anywhere raises on every rank, naming the rank and its error. A rank that neither
arrives nor fails within the timeout is named as missing.

Leaving a meeting is a second handshake: the store lives in one rank's process (rank 0 under
``env://``), so a rank that saw everyone arrive and then exited could close the store under a peer
still reading the last "arrived" keys. Each rank counts itself out once it saw every rank arrive,
and rank 0 leaves last, when every rank counted itself out (the others' last store call, the
count, has then been answered).
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

from .._torch.c10d import default_store

POLL_S = 0.05
LEAVE_TIMEOUT_S = 60.0  # rank 0 waits this long at most for the others to count themselves out
_calls = itertools.count()


class RankFailedError(RuntimeError):
    """Another rank failed at a step every rank takes part in (raised on every rank)."""

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#rankfailederror)"


class Agreement:
    """The meeting points of one collective operation (``what``), on every rank of ``ranks``."""

    def __init__(self, what: str, ranks: list[int] | None = None, timeout_s: float = 600.0):
        self.what = what
        self.ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        self.timeout_s = timeout_s
        self.store = default_store()
        # every rank creates its agreements in the same order: the same prefix everywhere
        self.prefix = f"zero3/agree/{next(_calls)}/"
        self.stage = 0
        self.failed = False

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{self.stage}/{kind}/{rank}"

    def meet(self, step: str) -> None:
        """Wait until every rank finished ``step``; raise if one failed."""
        if self.store is None or len(self.ranks) == 1:
            return
        me = dist.get_rank()
        self.store.set(self._key("arrived", me), "1")
        deadline = time.monotonic() + self.timeout_s
        pending = set(self.ranks)
        while True:
            for rank in list(pending):
                if self.store.check([self._key("failed", rank)]):
                    message = self.store.get(self._key("failed", rank)).decode()
                    raise RankFailedError(
                        f"zero3: {self.what} failed on rank {rank} while {step}: {message}"
                    )
                if self.store.check([self._key("arrived", rank)]):
                    pending.discard(rank)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"zero3: {self.what}: rank(s) {sorted(pending)} did not finish {step} within "
                    f"{self.timeout_s:.0f}s (dead, stuck, or not running this call)"
                )
            time.sleep(POLL_S)
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
            time.sleep(POLL_S)
            left = self.store.add(f"{self.prefix}{self.stage}/left", 0)

    def fail(self, error: BaseException) -> None:
        """From an ``except`` handler: tell the other ranks (once); the caller re-raises."""
        if self.store is None or self.failed or isinstance(error, RankFailedError):
            return
        self.failed = True
        text = f"{type(error).__name__}: {error}".strip()[:2000]
        try:
            self.store.set(self._key("failed", dist.get_rank()), text)
        except Exception:  # noqa: BLE001 - the store itself is gone: the peers time out
            pass
