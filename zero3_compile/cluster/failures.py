"""What a rank that failed reports (``Failure``), and the error every rank then raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    """Rank ``rank`` failed (or was lost) with ``reason`` (``"OSError: ..."``).

    Example:
        ```python
        str(Failure(1, "OSError: No space left on device"))
        # 'rank 1: OSError: No space left on device'
        ```
    """

    rank: int
    reason: str

    @classmethod
    def of(cls, rank: int, error: BaseException) -> Failure:
        return cls(rank, f"{type(error).__name__}: {error}")

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.reason}"


# what a caller turns the failures into (the same on every rank: built from the same records)
ErrorFactory = Callable[[list[Failure]], BaseException]


class RankFailedError(RuntimeError):
    """Another rank failed at a step every rank takes part in (raised on every rank);
    ``failures`` holds each failed rank and its reason.

    Example:
        ```python
        from zero3_compile.cluster import RankFailedError

        try:
            model = z3hf.from_pretrained(AutoModelForCausalLM, path)
        except RankFailedError as error:
            print([f.rank for f in error.failures])  # every rank stops here, none hangs
        ```
    """

    def __init__(self, message: str, *, failures: Sequence[Failure] = ()):
        super().__init__(message)
        self.failures = list(failures)

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#rankfailederror)"

    def __reduce__(self):  # whole across processes
        return type(self), (self.args[0],), {"failures": self.failures}


def failed(what: str) -> ErrorFactory:
    """The default error: ``RankFailedError`` saying ``what`` failed, rank by rank."""

    def error(failures: list[Failure]) -> BaseException:
        listed = "; ".join(str(f) for f in failures)
        return RankFailedError(f"zero3: {what} failed on {listed}", failures=failures)

    return error
