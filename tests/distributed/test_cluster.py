"""The agreement primitive (``zero3_compile.cluster``): every rank goes on, or every rank raises
the same error naming the failed rank(s) and each one's reason; never one rank alone."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from zero3_compile.cluster import (
    Failure,
    Meeting,
    RankFailedError,
    agree,
    attempt,
    lost_ranks,
    roll_call,
    same,
)

from ..support.dist_utils import run_ranks


class Disk(ValueError):
    pass


def _outcome(fn):
    """("ok", value) or (error type, message, failures' ranks, cause type) of ``fn()``."""
    try:
        return ("ok", fn())
    except Exception as error:  # noqa: BLE001
        cause = type(error.__cause__).__name__ if error.__cause__ is not None else None
        ranks = [f.rank for f in getattr(error, "failures", [])]
        return (type(error).__name__, str(error), ranks, cause)


def _scenarios(rank, world):
    def fail_on(ranks, value=None):
        def fn():
            if rank in ranks:
                raise Disk(f"no space on rank {rank}")
            return value if value is not None else rank * 10

        return fn

    def as_value_error(failures):
        return ValueError("zero3: stopped: " + "; ".join(str(f) for f in failures))

    out = {
        "values": _outcome(lambda: agree({"rank": rank}, what="counting")),
        "one_fails": _outcome(lambda: attempt(fail_on({1}), what="sealing")),
        "both_fail": _outcome(lambda: attempt(fail_on({0, 1}), what="sealing")),
        "own_type": _outcome(lambda: attempt(fail_on({0}), error=as_value_error)),
        "subgroup": _outcome(
            lambda: attempt(fail_on(set()), over=(dist.new_group([0, 1]), None), what="x")
        ),
    }
    # an exception ``catch`` does not cover is not agreed on: only the rank that raised it sees it
    # (all ranks raise here, so no rank waits in the exchange)
    out["not_caught"] = _outcome(lambda: attempt(fail_on({0, 1}), catch=KeyError))
    out["same_ok"] = _outcome(lambda: same(7, error=lambda holders: ValueError(str(holders))))
    out["same_differs"] = _outcome(
        lambda: same(rank % 2, error=lambda holders: ValueError(repr(holders)))
    )

    # meetings in the store: rank 1 fails between two points and posts it; rank 0 learns it at
    # its next meet, without rank 1 ever reaching it
    meeting = Meeting("loading", timeout_s=60)
    if rank == 1:
        meeting.fail(Disk("rows unreadable"))
        out["meeting"] = ("left", None)
    else:
        out["meeting"] = _outcome(lambda: meeting.meet("reading the rows"))
    dist.barrier()
    # a rank that never arrives is named after the timeout
    late = Meeting("saving", timeout_s=0.5)
    if rank == 0:
        start = time.monotonic()
        out["missing"] = _outcome(lambda: late.meet("writing"))
        out["missing_s"] = time.monotonic() - start
    dist.barrier()
    ok = Meeting("both arrive", timeout_s=60)
    out["met"] = _outcome(lambda: ok.meet("step"))
    # after a failed collective: rank 1 does not answer the roll call, rank 0 names it
    if rank == 0:
        out["lost"] = lost_ranks("test/rollcall/a/", range(world), wait_s=0.3)
    dist.barrier()
    out["none_lost"] = lost_ranks("test/rollcall/b/", range(world), wait_s=30)
    out["alive"] = sorted(roll_call("test/rollcall/b/", range(world), wait_s=30))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_scenarios, 2, timeout=120)


def test_every_rank_gets_every_value_when_all_succeed(results):
    for r in results:
        assert r["values"] == ("ok", [{"rank": 0}, {"rank": 1}])
        assert r["subgroup"] == ("ok", [0, 10])
        assert r["same_ok"] == ("ok", None)
        assert r["met"] == ("ok", None)


def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank(results):
    messages = {r["one_fails"][1] for r in results}
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith("zero3: sealing failed on rank 1: Disk: no space on rank 1")
    assert all(r["one_fails"][0] == "RankFailedError" and r["one_fails"][2] == [1] for r in results)
    # the failed rank's own exception is the cause of its error; the other rank has none
    assert [r["one_fails"][3] for r in results] == [None, "Disk"]


def test_every_failed_rank_is_named_with_its_reason(results):
    for r in results:
        kind, message, ranks, _ = r["both_fail"]
        assert kind == "RankFailedError" and ranks == [0, 1]
        assert "rank 0: Disk: no space on rank 0; rank 1: Disk: no space on rank 1" in message


def test_the_caller_chooses_the_error_type(results):
    for r in results:
        assert r["own_type"][:2] == (
            "ValueError",
            "zero3: stopped: rank 0: Disk: no space on rank 0",
        )
        assert r["not_caught"][0] == "Disk"


def test_ranks_holding_different_values_are_grouped(results):
    for r in results:
        assert r["same_differs"][:2] == ("ValueError", "[[0], [1]]")


def test_a_meeting_raises_a_peers_failure_and_names_a_rank_that_never_came(results):
    kind, message, ranks, _ = results[0]["meeting"]
    assert kind == "RankFailedError" and ranks == [1]
    assert (
        "zero3: loading failed on rank 1 while reading the rows: Disk: rows unreadable" in message
    )
    kind, message, ranks, _ = results[0]["missing"]
    assert kind == "RankFailedError" and ranks == [1]
    assert "rank(s) [1] did not finish writing within 0s" in message
    assert results[0]["missing_s"] < 20


def test_a_roll_call_names_the_ranks_that_do_not_answer(results):
    assert results[0]["lost"] == [1]
    assert [r["none_lost"] for r in results] == [[], []]
    assert [r["alive"] for r in results] == [[0, 1], [0, 1]]


def test_without_a_process_group_the_outcome_is_this_process_alone():
    if dist.is_initialized():
        pytest.skip("another test module left a process group in this process")
    assert agree(3) == [3]
    with pytest.raises(RankFailedError) as caught:
        attempt(lambda: 1 / 0, what="dividing")
    assert caught.value.failures == [Failure(0, "ZeroDivisionError: division by zero")]
    assert str(caught.value).startswith("zero3: dividing failed on rank 0: ZeroDivisionError")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    same("x", error=lambda holders: AssertionError(holders))
