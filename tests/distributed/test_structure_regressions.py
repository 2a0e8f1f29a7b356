"""Model structures that once failed, each trained sharded against single-process eager
(2 gloo ranks, and 1 where the bug was a single rank's; eager codegen; one process launch per
world size): losses, gradients and final parameters.

Each scenario is named after what broke; the docstring of its model says what it was.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.nn as nn

from ..support.dist_utils import run_scenarios
from ..support.structure_runner import Training, train_and_compare

EAGER = {"codegen": "eager"}


def _batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return (torch.randn(3, 4, generator=g),), torch.randn(3, 4, generator=g)


def _mse(out, target):
    return (out - target).square().mean()


class SummedListBranches(nn.Module):
    """Issue 61 item 1: two Linears of one ModuleList, fed the same input and summed. Their
    gradients are the same graph nodes (autograd's CSE), but the branches are two blocks, so two
    reduce buckets shared one "last gradient" and were issued in reverse index order: a bucket's
    wait landed before its reduce-scatter ("used before it has been defined")."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        return self.branches[0](x) + self.branches[1](x)


class SummedAttributes(nn.Module):
    """The same bug through two plain attributes: with one parameter per bucket (tiny
    ``bucket_mb``) the two weights' buckets share their last gradient too."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) + self.b(x)


class NoGradModuleBesideUnusedOutput(nn.Module):
    """Found by the structure fuzzer: ``m0`` is read under ``no_grad`` only, and a second output
    the loss ignores makes the graph gate its parameters' gradients (``runtime/gate.py``). The
    gate materialised the missing gradient of ``m0.weight`` as plain zeros: ``.grad`` became a
    plain tensor (eager: None) and ``optimizer.step()`` failed on mixing it with the DTensor
    parameter (SGD's weight decay or momentum would have moved a parameter eager leaves alone)."""

    def __init__(self):
        super().__init__()
        self.m0 = nn.Linear(4, 4, bias=False)
        self.m1 = nn.Linear(4, 4)

    def forward(self, x):
        h1 = self.m1(x)
        with torch.no_grad():
            h2 = self.m0(x)
        return h2 + self.m1.bias, h1


class ParameterWrittenIntoOutput(nn.Module):
    """Found by the structure fuzzer: the output is a clone of the input that an in-place op
    fills from a parameter (``h = x.clone(); h.add_(x + b)``, through a view, or ``h[:, 0] =``).
    The write's node has no users, so the data flow the gradient gate reads
    (``graph_facts.output_dependencies``) missed it: the parameter counted as reaching no output
    and its gradient was dropped (None where eager has one: it never trained)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.m0 = nn.Linear(4, 4)

    def forward(self, x):
        h = x.clone()
        if self.how == "add_":
            h.add_(x + self.m0.bias)
        elif self.how == "view":
            h[:, ::2].mul_(self.m0.bias[::2])
        else:
            h[:, 0] = (x * self.m0.bias)[:, 1]
        return h


class NoGradReadAcrossGraphBreak(nn.Module):
    """Found by the structure fuzzer: ``a``'s output crosses a graph break and is read there
    under ``no_grad`` only. The second graph took it as an input with a gradient edge (AOTAutograd
    detaches such inputs itself, but not in graphs with tensor-subclass inputs like ours), so
    backward ran the first graph with no gradient: ``a``'s parameters got zeros (eager: None),
    which momentum and weight decay then applied."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        h1 = self.a(x)
        torch._dynamo.graph_break()
        with torch.no_grad():
            self.b(h1)
        return self.c(x)


def _first_output_mse(out, target):
    return (out[0] - target).square().mean()


SCENARIOS = {
    "summed_list_branches": (SummedListBranches, _mse, Training(EAGER)),
    "summed_list_branches_deep_reduce": (
        SummedListBranches,
        _mse,
        Training({**EAGER, "reduce_scatter_depth": 2, "bucket_mb": 0.00001}),
    ),
    "summed_attributes_one_param_per_bucket": (
        SummedAttributes,
        _mse,
        Training({**EAGER, "bucket_mb": 0.00001}),
    ),
    "no_grad_module_beside_unused_output": (
        NoGradModuleBesideUnusedOutput,
        _first_output_mse,
        Training(EAGER),
    ),
    **{
        f"parameter_written_into_output_{how}": (
            functools.partial(ParameterWrittenIntoOutput, how),
            _mse,
            Training(EAGER),
        )
        for how in ("add_", "view", "setitem")
    },
    "no_grad_read_across_graph_break": (NoGradReadAcrossGraphBreak, _mse, Training(EAGER)),
}


# on one rank the reduced gradient is (a view of) the graph's gradient, no collective between
ONE_RANK = {
    # Found by the structure fuzzer: the summed branches' gradients are one graph node (autograd's
    # CSE), so both weights' .grad were views of one tensor; accumulating micro-batches into one
    # added into the other too (grads 2x-3x too large, silently)
    "one_rank_summed_branches_accumulated": (
        SummedListBranches,
        _mse,
        Training(EAGER, micro_batches=2),
    ),
    "one_rank_summed_branches_plain_accumulation": (
        SummedListBranches,
        _mse,
        Training(EAGER, micro_batches=2, sync_off=False),
    ),
}


def _run(rank, world, name):
    torch._dynamo.reset()
    make_model, loss_fn, training = {**SCENARIOS, **ONE_RANK}[name]
    torch.manual_seed(0)
    try:
        return train_and_compare(rank, world, make_model(), loss_fn, _batch, training)
    except Exception:  # every rank raises alike here: report it, run the next scenario
        return [f"raised: {traceback.format_exc(limit=-6)}"]


@functools.cache
def _results(world: int):
    names = SCENARIOS if world == 2 else ONE_RANK
    return run_scenarios(_run, world, [(name,) for name in names])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_structure_trains_like_eager(name):
    for rank, problems in enumerate(_results(2)[(name,)]):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.parametrize("name", list(ONE_RANK))
def test_structure_trains_like_eager_on_one_rank(name):
    (problems,) = _results(1)[(name,)]
    assert problems == [], problems
