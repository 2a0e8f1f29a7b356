"""The partitioned graphs: nothing gathered is saved for backward; backward gathers again."""

from __future__ import annotations

import pytest

from ..support.runs import results


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_forward_saves_no_gathered_parameter_and_backward_regathers(codegen):
    for rank, per_rank in enumerate(results(2, codegen)):
        graphs = per_rank["gpt/sgd/c"]["graphs"]
        forward, backward = graphs["forward"], graphs["backward"]
        assert forward["saved"] > 0
        assert forward["saved_gathered"] == [], f"rank {rank} saves {forward['saved_gathered']}"
        assert forward["all_gather"] > 0 and forward["reduce_scatter"] == 0
        assert backward["all_gather"] > 0, "backward must gather the parameters it needs again"
        assert backward["reduce_scatter"] > 0


def test_check_detects_saved_parameters_when_they_are_kept():
    """Negative control: reshard_after_forward=False saves the gathered parameters on purpose
    (ZeRO-2-like), and the same structural check finds them; backward then gathers nothing."""
    for per_rank in results(2, "eager"):
        graphs = per_rank["gpt/sgd/keep"]["graphs"]
        assert graphs["forward"]["saved_gathered"], "the check failed to see saved parameters"
        assert graphs["backward"]["all_gather"] == 0
        assert graphs["backward"]["reduce_scatter"] > 0
