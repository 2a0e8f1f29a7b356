"""Bad input gets a clear error that names the fix."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import zero3_compile as z3


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


@functools.cache
def _without_process_group() -> subprocess.CompletedProcess:
    """shard() and the backend in a process that never initialised torch.distributed."""
    return run_python(
        """
        import torch, torch.nn as nn, zero3_compile as z3
        for attempt in (lambda: z3.shard(nn.Linear(2, 2)),
                        lambda: torch.compile(nn.Linear(2, 2), backend="zero3")(torch.randn(1, 2))):
            try:
                attempt()
                print("NO ERROR")
            except Exception as error:
                print("ERROR:", str(error).replace("\\n", " "))
        """
    )


def test_shard_without_process_group_says_to_initialise_it():
    lines = _without_process_group().stdout.splitlines()
    assert lines[0].startswith("ERROR:"), lines
    assert "torch.distributed is not initialised" in lines[0] and "init_process_group()" in lines[0]


def test_backend_without_process_group_says_to_initialise_it():
    lines = _without_process_group().stdout.splitlines()
    assert lines[1].startswith("ERROR:"), lines
    assert "torch.distributed is not initialised" in lines[1]


def _backend_error(fn) -> BaseException:
    """The error the backend raised (dynamo wraps it in BackendCompilerFailed)."""
    from torch._dynamo.exc import BackendCompilerFailed

    with pytest.raises(BackendCompilerFailed) as info:
        fn()
    return info.value.inner_exception


def test_backend_on_unsharded_model_says_to_shard_it(fake_pg):
    model = nn.Linear(3, 3)
    error = _backend_error(
        lambda: torch.compile(model, backend="zero3", options={"codegen": "eager"})(
            torch.randn(2, 3)
        )
    )
    assert isinstance(error, ValueError)
    assert re.search(r"not sharded.*call zero3_compile.shard\(model\)", str(error))


def test_module_added_after_shard_without_a_sharded_parent_is_refused(fake_pg):
    """A module holding plain parameters slipped in next to sharded ones (through a container
    that is not part of the sharded model) trains differently on every rank: refused."""
    model = z3.shard(nn.Linear(4, 4))
    extra = nn.Linear(4, 4)
    step = torch.compile(lambda x: extra(model(x)), backend="zero3", options={"codegen": "eager"})
    error = _backend_error(lambda: step(torch.randn(2, 4)))
    assert isinstance(error, ValueError)
    assert "added to the model after zero3_compile.shard(model)" in str(error)
    assert "zero3_compile.shard(new_module)" in str(error)


def test_sharding_twice_is_refused(fake_pg):
    model = z3.shard(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="already sharded.*once per model"):
        z3.shard(model)


def test_parameters_on_different_devices_are_refused(fake_pg):
    model = nn.Linear(4, 4)
    model.bias = nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match=r"different devices.*model\.to\(device\)"):
        z3.shard(model)


def test_zero_dim_parameter_is_refused_with_a_fix(fake_pg):
    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"0-dim.*reshape\(1\)"):
        z3.shard(model)


def test_unknown_option_lists_the_valid_ones(fake_pg):
    model = z3.shard(nn.Linear(8, 8))
    error = _backend_error(
        lambda: torch.compile(model, backend="zero3", options={"prefetch": 2})(torch.randn(2, 8))
    )
    assert isinstance(error, ValueError)
    assert re.search(
        r"unknown option\(s\) \['prefetch'\].*valid options are: codegen, bucket_mb", str(error)
    )


@pytest.mark.parametrize(
    "options,message",
    [
        ({"codegen": "cuda"}, "codegen='cuda' is not one of"),
        ({"bucket_mb": 0}, "bucket_mb must be a positive number"),
        ({"prefetch_depth": -1}, "prefetch_depth must be an int >= 0"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward must be True or False"),
    ],
)
def test_bad_option_values_are_explained(options, message):
    with pytest.raises(ValueError, match=message):
        z3.Options.from_dict(options)
