"""Checkpoints: sharded DCP save at 2 ranks / load at 3, full single-file, atomicity, safe loading."""

from __future__ import annotations

import functools
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import zero3_compile as z3
from zero3_compile.io.checkpoint import SafeFileSystemReader
from zero3_compile.io.checkpoint.durable import existing as _existing
from zero3_compile.io.checkpoint.durable import swap_in as _swap_in

from ..support.dist_utils import run_ranks
from ..support.models import GPT, gpt_batch, gpt_loss


def _train_a_little(model, opt, world_size, rank, steps=2):
    step_model = model  # eager (uncompiled) sharded training: checkpoints do not depend on it
    idx, targets = gpt_batch(2 * world_size, seed=7)
    mine = slice(2 * rank, 2 * rank + 2)
    for _ in range(steps):
        gpt_loss(step_model, (idx[mine], targets[mine])).backward()
        opt.step()
        opt.zero_grad()


def _full_optimizer_state(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in opt.param_groups for p in group["params"]]
    out = {}
    # the state dict: an offloaded optimizer's state is read back from its store there
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"{names[id(params[index])]}.{key}"] = (
                value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
            )
    return out


def _save(rank, world_size, folder):
    torch.manual_seed(0)
    model = z3.shard(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_a_little(model, opt, world_size, rank)
    z3.save_checkpoint(os.path.join(folder, "sharded"), model, opt)
    z3.save_full_state_dict(os.path.join(folder, "full.pt"), model)
    first = {"model": z3.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    # train on, then a second save whose writing fails on rank 1: the first must survive
    _train_a_little(model, opt, world_size, rank)
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("disk full (simulated)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = failing_write
    try:
        z3.save_checkpoint(os.path.join(folder, "sharded"), model, opt)
        first["interrupted_save_raised"] = False
    except BaseException:  # DCP's CheckpointException derives from BaseException
        first["interrupted_save_raised"] = True
    finally:
        FileSystemWriter.write_data = original
    dist.barrier()
    return first


def _load(rank, world_size, folder):
    torch.manual_seed(123)  # different values everywhere before loading
    model = z3.shard(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    z3.load_checkpoint(os.path.join(folder, "sharded"), model, opt)
    loaded = {"model": z3.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}
    fresh = z3.shard(GPT())
    z3.load_full_state_dict(
        fresh, os.path.join(folder, "full.pt") if rank == 0 else None, broadcast_from_rank0=True
    )
    loaded["from_full_file"] = z3.full_state_dict(fresh)
    # the same checkpoint into shards and optimizer state on disk: written to the stores as DCP
    # reads them, items cut where the two-rank chunks meet the three-rank ones
    offloaded = z3.shard(GPT(), offload=z3.Offload(params="disk", path=folder))
    offloaded_opt = z3.offload_optimizer(
        torch.optim.AdamW(offloaded.parameters(), lr=1e-2), tier="disk", path=folder
    )
    z3.load_checkpoint(os.path.join(folder, "sharded"), offloaded, offloaded_opt)
    loaded["offloaded"] = {
        "model": z3.full_state_dict(offloaded),
        "optim": _full_optimizer_state(offloaded, offloaded_opt),
    }
    # training continues from the checkpoint
    _train_a_little(model, opt, world_size, rank, steps=1)
    _train_a_little(offloaded, offloaded_opt, world_size, rank, steps=1)
    loaded["offloaded_after_a_step"] = z3.full_state_dict(offloaded)
    loaded["after_a_step"] = z3.full_state_dict(model)
    return loaded


@functools.cache
def roundtrip(folder: str):
    saved = run_ranks(_save, 2, folder, timeout=600)
    loaded = run_ranks(_load, 3, folder, timeout=600)
    return saved, loaded


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ckpt"))
    return folder, *roundtrip(folder)


def _assert_same_state(got: dict, want: dict) -> None:
    for part in ("model", "optim"):
        assert got[part].keys() == want[part].keys(), part
        for key, value in want[part].items():
            assert torch.equal(got[part][key], value), key


def test_sharded_checkpoint_saved_at_two_ranks_loads_at_three_with_identical_values(checkpoint):
    _, saved, loaded = checkpoint
    for got in loaded:
        _assert_same_state(got, saved[0])


def test_a_checkpoint_loads_at_another_world_size_into_offloaded_state_identically(checkpoint):
    _, saved, loaded = checkpoint
    for got in loaded:
        _assert_same_state(got["offloaded"], saved[0])
        # and it trains on as the same checkpoint loaded into memory does
        for key, value in got["after_a_step"].items():
            assert torch.equal(got["offloaded_after_a_step"][key], value), key


def test_interrupted_save_keeps_the_previous_checkpoint(checkpoint):
    folder, saved, loaded = checkpoint
    assert all(s["interrupted_save_raised"] for s in saved)
    # the loads above read the first checkpoint's values, not the interrupted second one
    for key, value in saved[0]["model"].items():
        assert torch.equal(loaded[0]["model"][key], value)
    assert not [name for name in os.listdir(folder) if ".tmp-" in name]  # staging cleaned up


def test_full_single_file_loads_into_the_plain_model_strictly(checkpoint):
    folder, saved, loaded = checkpoint
    state = torch.load(os.path.join(folder, "full.pt"), weights_only=True)
    plain = GPT()
    plain.load_state_dict(state, strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, saved[0]["model"][key]), key
    for got in loaded:  # and back into a sharded model at another world size
        for key, value in saved[0]["model"].items():
            assert torch.equal(got["from_full_file"][key], value), key


def test_crash_between_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    old, new = tmp_path / "ckpt", tmp_path / "ckpt.tmp-1"
    old.mkdir()
    (old / "marker").write_text("old")
    new.mkdir()
    (new / "marker").write_text("new")
    os.rename(old, str(old) + ".zero3-previous")  # crash right after moving the old one aside
    assert (open(os.path.join(_existing(str(old)), "marker")).read()) == "old"
    _swap_in(str(new), str(old))  # the next save completes the swap
    assert (old / "marker").read_text() == "new"
    assert not os.path.exists(str(old) + ".zero3-previous")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/zero3-pwned",))


def test_loading_metadata_never_unpickles_arbitrary_objects(tmp_path):
    if os.path.exists("/tmp/zero3-pwned"):
        os.remove("/tmp/zero3-pwned")
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not os.path.exists("/tmp/zero3-pwned")
