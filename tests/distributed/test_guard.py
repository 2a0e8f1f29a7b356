"""Ranks about to issue different collectives get a clear error on every rank, at once, instead
of a hang or mixed buffers; ranks that compiled different numbers of times but issue the same
collectives train on."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

import zero3_compile as z3
from zero3_compile.runtime.guard import CollectiveMismatchError

from ..support.dist_utils import run_ranks


class RankDependent(nn.Module):
    """A model whose forward uses another layer on rank 0: a bug the check must catch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if dist.get_rank() == 0 else x


def _describe(error: BaseException) -> str:
    """dynamo wraps errors in its own types; look at the error inside."""
    while error is not None and not isinstance(error, CollectiveMismatchError):
        error = getattr(error, "inner_exception", None) or error.__cause__
    return "mismatch: " + str(error) if error is not None else "other"


def _rank_dependent(rank, world_size, codegen):
    torch.manual_seed(0)
    model = z3.shard(RankDependent(), sync_timeout_s=60)
    step = (
        model
        if codegen is None
        else torch.compile(model, backend="zero3", options={"codegen": codegen})
    )
    start = time.monotonic()
    try:
        step(torch.randn(4, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001
        return _describe(error), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_rank_dependent_graphs_raise_on_every_rank_at_once():
    for message, seconds in run_ranks(_rank_dependent, 2, "eager", timeout=300):
        assert message.startswith("mismatch: "), message
        assert "about to issue different collectives" in message
        assert "rank 0 (this rank)" in message or "rank 1 (this rank)" in message
        assert "forward graph" in message
        assert seconds < 30  # compiling both graphs included; no waiting for a timeout


def test_rank_dependent_eager_reads_raise_naming_the_parameters():
    for message, _ in run_ranks(_rank_dependent, 2, None, timeout=300):
        assert message.startswith("mismatch: "), message
        assert "eager all-gather 'b.weight'" in message  # rank 0 reads b, rank 1 does not
        assert "set_leaf_modules" in message


def _different_lengths(rank, world_size):
    """Rank 1 sees another sequence length on step 1: it recompiles alone, with the same
    collectives, and must train on (the check compares what is issued, not compile counts)."""
    torch.manual_seed(0)
    model = z3.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    losses = []
    for i in range(3):
        rows = 4 if rank == 0 or i == 0 else 3 + i
        x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(i))
        loss = step(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses


def test_recompiling_alone_with_the_same_collectives_trains_on():
    losses = run_ranks(_different_lengths, 2, timeout=300)
    assert all(len(rank_losses) == 3 for rank_losses in losses)


def _one_rank_stops(rank, world_size):
    torch.manual_seed(0)
    model = z3.shard(nn.Linear(8, 8), sync_timeout_s=3)
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    step(torch.randn(2, 8)).sum().backward()
    if rank == 1:
        time.sleep(12)  # busy elsewhere: never reaches the next forward in time
        return "slept", 0.0
    start = time.monotonic()
    try:
        step(torch.randn(2, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001
        return _describe(error), time.monotonic() - start
    return "no error", 0.0


def test_a_rank_that_does_not_arrive_is_named_within_the_timeout():
    message, seconds = run_ranks(_one_rank_stops, 2, timeout=300)[0]
    assert message.startswith("mismatch: "), message
    assert "rank(s) [1] did not arrive within 3s" in message
    assert seconds < 10
