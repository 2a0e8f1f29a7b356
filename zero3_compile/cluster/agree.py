"""``agree``: each rank's outcome of a step to every rank, over a collective.

Every rank of the group (or of each group of ``over`` in turn: the dimensions of a 2-D mesh)
calls ``agree`` with its value or its failure; one all-gather of those small records later, every
rank returns every rank's value, or every rank raises the same error, built by ``error`` from the
failed ranks' records, in rank order (on a rank that failed, chained to its own exception). A
rank that dies instead of calling makes the collective itself fail (gloo: at once; otherwise
after the process group's timeout): ``lost_ranks`` then names it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from .failures import ErrorFactory, Failure, failed

T = TypeVar("T")
# a process group, the default one (None), or the groups of a mesh's dimensions, in turn
Over = Any


def agree(
    value: Any = None,
    *,
    failure: BaseException | None = None,
    over: Over = None,
    error: ErrorFactory | None = None,
    what: str = "a step every rank takes part in",
) -> list[Any]:
    """Every rank's ``value`` (by global rank), unless ``failure`` is set on some rank: then
    every rank raises ``error(failures)`` (default ``RankFailedError`` naming ``what``); a
    collective of every rank of ``over``.

    Example:
        ```python
        failure = None
        try:
            open_my_store()
        except OSError as caught:
            failure = caught
        agree(failure=failure, what="opening the stores")  # raises on every rank, or returns
        ```
    """
    records = _exchange((dist.get_rank() if dist.is_initialized() else 0, failure, value), over)
    failures = [Failure(rank, reason) for rank, reason, _ in records if reason is not None]
    if failures:
        raise (error or failed(what))(failures) from failure
    return [payload for _, _, payload in records]


def attempt(
    fn: Callable[[], T],
    *,
    catch: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    over: Over = None,
    error: ErrorFactory | None = None,
    what: str = "a step every rank takes part in",
) -> list[T]:
    """``fn()`` on every rank, then ``agree`` on its outcome (an exception of type ``catch`` is
    the rank's failure).

    Example:
        ```python
        sizes = attempt(lambda: os.path.getsize(my_file), what="sealing the files")
        ```
    """
    try:
        value, failure = fn(), None
    except catch as caught:
        value, failure = None, caught
    return agree(value, failure=failure, over=over, error=error, what=what)


def same(
    value: Any, *, over: Over = None, error: Callable[[list[list[int]]], BaseException]
) -> None:
    """Raise ``error(holders)`` on every rank unless every rank passed an equal ``value`` (a
    digest, a count); ``holders`` lists the ranks by the value they hold (each list sorted, the
    lists sorted).

    Example:
        ```python
        same(zlib.crc32(names), error=lambda holders: ValueError(f"differ: {holders}"))
        ```
    """
    records = _exchange((dist.get_rank() if dist.is_initialized() else 0, None, value), over)
    holders: dict[Any, list[int]] = {}
    for rank, _, held in records:
        holders.setdefault(held, []).append(rank)
    if len(holders) > 1:
        raise error(sorted(holders.values()))


def _exchange(record: tuple[int, Any, Any], over: Over) -> list[tuple[int, str | None, Any]]:
    """Every rank's (global rank, failure reason or None, value), sorted by rank."""
    rank, failure, value = record
    records = [(rank, None if failure is None else Failure.of(rank, failure).reason, value)]
    groups = over if isinstance(over, Sequence) else [over]
    if dist.is_initialized():
        for group in groups:
            if group is None and over is not None:  # a mesh dimension that is not there
                continue
            size = dist.get_world_size(group)
            if size == 1:
                continue
            gathered: list[Any] = [None] * size
            dist.all_gather_object(gathered, records, group=group)
            records = [r for part in gathered for r in part]
    return sorted(records, key=lambda r: r[0])
