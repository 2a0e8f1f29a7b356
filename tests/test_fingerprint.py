"""Ranks that would issue different collectives get a clear error instead of a hang."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import zero3_compile as z3
from zero3_compile.fingerprint import CollectiveMismatchError

from .dist_utils import run_ranks


class RankDependent(nn.Module):
    """A model whose forward uses another layer on rank 0: a bug the check must catch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        return self.b(x) if dist.get_rank() == 0 else x


def _rank_dependent(rank, world_size):
    torch.manual_seed(0)
    model = z3.shard(RankDependent())
    step = torch.compile(model, backend="zero3", options={"codegen": "eager", "sync_timeout_s": 60})
    try:
        step(torch.randn(4, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001
        return _describe(error)
    return "no error"


def _describe(error: Exception) -> str:
    """dynamo wraps backend errors in BackendCompilerFailed; look at the error inside."""
    inner = getattr(error, "inner_exception", None) or error
    if isinstance(inner, CollectiveMismatchError):
        return "mismatch: " + str(inner)
    return "other: " + repr(error)


def test_different_collectives_across_ranks_raise_on_every_rank():
    messages = run_ranks(_rank_dependent, 2, timeout=300)
    for message in messages:
        assert message.startswith("mismatch: "), message
        assert "compiled different collectives" in message
        assert "rank 0 issues ('all_gather'" in message


def _shape_change(rank, world_size):
    torch.manual_seed(0)
    model = z3.shard(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    step = torch.compile(model, backend="zero3", options={"codegen": "eager", "sync_timeout_s": 5})
    step(torch.randn(4, 8)).sum().backward()
    try:
        # rank 1 gets another batch size: dynamo recompiles on rank 1 only
        step(torch.randn(4 if rank == 0 else 3, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001  (rank 0: its peer left the collective)
        return _describe(error)
    return "no error"


def test_recompile_on_one_rank_times_out_with_a_clear_error_not_a_hang():
    messages = run_ranks(_shape_change, 2, timeout=300)
    assert messages[1].startswith("mismatch: "), messages[1]
    assert "did not compile a graph within 5s" in messages[1]
    assert "torch._dynamo.mark_dynamic" in messages[1]
    assert messages[0] != "no error"  # rank 0's collective failed once rank 1 gave up
