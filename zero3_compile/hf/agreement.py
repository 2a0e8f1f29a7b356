"""Every rank learns at once when one rank failed while loading or saving a Hugging Face model,
instead of the others waiting in a collective: the meeting points of ``zero3_compile.cluster``
(``Meeting``), polled every ``POLL_S`` seconds."""

from __future__ import annotations

from ..cluster import Meeting, RankFailedError

__all__ = ["Agreement", "RankFailedError"]

POLL_S = 0.05  # read when an Agreement is made


class Agreement(Meeting):
    """The meeting points of one collective operation (``what``), on every rank of ``ranks``."""

    def __init__(self, what: str, ranks: list[int] | None = None, timeout_s: float = 600.0):
        super().__init__(what, ranks, timeout_s, poll_s=POLL_S)
