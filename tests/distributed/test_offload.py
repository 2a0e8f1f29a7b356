"""Offload: parameter shards and optimizer state on disk between uses (2 gloo ranks).

Every configuration is trained side by side with the same model without offload, in the same
processes and on the same batches: losses, parameters and optimizer state must be bit-identical.
"""

from __future__ import annotations

import copy
import errno
import functools
import importlib
import os
import shutil
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero3_compile as z3
from zero3_compile.compiler.memory import memory_timeline
from zero3_compile.io.checkpoint import hashing, reader
from zero3_compile.offload import grads as grads_module
from zero3_compile.offload import store as store_module
from zero3_compile.offload.grads import spooled
from zero3_compile.offload.params import offloaded_states

from ..support.dist_utils import run_ranks, run_scenarios
from ..support.models import GPT, GPTConfig, gpt_batch, gpt_loss


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _full_optimizer_state(opt) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [
        v.full_tensor() if hasattr(v, "full_tensor") else v
        for key in sorted(state)
        for _, v in sorted(state[key].items())
    ]


def _train(rank, world, model, opt, codegen, steps, accumulate, seed0=0, clip=False, seen=None):
    """``accumulate``: False, True (two micro-batches, synchronised on the last) or "plain" (two
    micro-batches, each reduced, accumulated in ``.grad``). ``seen``: a list that receives
    whether every gradient was spooled before each step."""
    step = (
        model
        if codegen is None
        else torch.compile(model, backend="zero3", options={"codegen": codegen})
    )
    losses = []
    for i in range(steps):
        micro = 2 if accumulate else 1
        for k in range(micro):
            idx, targets = gpt_batch(2 * world, seed=100 * (seed0 + i) + k)
            mine = slice(2 * rank, 2 * rank + 2)
            if accumulate is True:
                z3.set_requires_gradient_sync(model, k == micro - 1)
            loss = gpt_loss(step, (idx[mine], targets[mine]))
            loss.backward()
        if seen is not None:
            seen.append(all(spooled(p) is not None for p in model.parameters()))
        if clip:  # small enough to clip every step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=i % 2 == 0)
        losses.append(loss.item())
    return losses


def identical(
    rank, world, codegen, params_tier, opt_tier, optimizer, accumulate=False, grads_tier=None,
    clip=False,
):  # fmt: skip
    torch.manual_seed(0)
    model = GPT()
    twin = copy.deepcopy(model)
    offload = (
        z3.Offload(params=params_tier, grads=grads_tier) if params_tier or grads_tier else None
    )
    z3.shard(model, offload=offload, sync_timeout_s=120)
    z3.shard(twin, sync_timeout_s=120)
    opt = _optimizer(optimizer, model.parameters())
    if opt_tier:
        opt = z3.offload_optimizer(opt, tier=opt_tier, tile_mb=0.05)
    twin_opt = _optimizer(optimizer, twin.parameters())
    seen: list[bool] = []
    by_hook = grads_module.spooled_by_hook
    with z3.record_graphs() as graphs:
        losses = _train(rank, world, model, opt, codegen, 3, accumulate, clip=clip, seen=seen)
    by_hook = grads_module.spooled_by_hook - by_hook
    with z3.record_graphs() as twin_graphs:
        twin_losses = _train(rank, world, twin, twin_opt, codegen, 3, accumulate, clip=clip)
    # offloaded shards read ahead: at most reload_depth (1) + 1 reads outstanding at any point
    reads_outstanding = max((_reads_outstanding(g.gm) for g in graphs), default=0)
    # what the backward graphs' estimate says they leave alive at their end (their gradients)
    # (backward graphs that reduce: with synchronisation off a graph fills the full-size sinks)
    left = [memory_timeline(g.gm).end_bytes for g in graphs if _spools(g)]
    twin_left = [memory_timeline(g.gm).end_bytes for g in twin_graphs if g.kind == "backward"]
    params, twin_params = z3.full_state_dict(model), z3.full_state_dict(twin)
    state, twin_state = _full_optimizer_state(opt), _full_optimizer_state(twin_opt)
    evicted = [
        name
        for name, p in model.named_parameters()
        if params_tier and p.to_local().untyped_storage().nbytes() != 0
    ]
    resident_state = sum(
        (v.to_local() if hasattr(v, "to_local") else v).untyped_storage().nbytes()
        for s in opt.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {
        "losses_equal": losses == twin_losses,
        "params_equal": all(torch.equal(params[k], twin_params[k]) for k in twin_params),
        "state_equal": len(state) == len(twin_state)
        and all(torch.equal(a, b) for a, b in zip(state, twin_state)),
        "not_evicted": evicted,
        "resident_state": resident_state if opt_tier else 0,
        "trained": losses[-1] != losses[0],
        "grads_spooled": all(seen),
        "spooled_by_hook": by_hook,
        "backward_end_bytes": (left, twin_left),
        "reads_outstanding": reads_outstanding,
    }


class _OwnAdamW(torch.optim.AdamW):
    """A user's optimizer class: its step could read more than one element."""


def pieces(rank, world, optimizer, grads_tier):
    """Parameters larger than a tile (a 512 x 64 tied embedding: 16384 elements per rank, tiles
    of 0.05 MiB) step in pieces of 4096 elements, bit-identical to the same optimizer in memory;
    an optimizer not known to be elementwise (a subclass may change ``step``) steps them whole."""
    from ..support.models import GPTConfig

    config = GPTConfig(vocab_size=512, n_embd=64)
    torch.manual_seed(0)
    model = GPT(config)
    twin = copy.deepcopy(model)
    z3.shard(model, offload=z3.Offload(params="disk", grads=grads_tier), sync_timeout_s=120)
    z3.shard(twin, sync_timeout_s=120)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        "subclass": lambda ps: _OwnAdamW(ps, lr=1e-2),
    }[optimizer]
    opt = z3.offload_optimizer(make(model.parameters()), tile_mb=0.05)
    # a slow store allocation widens the window in which two pieces' writes, in flight together
    # on the workers, could each find no region for new state (one allocated each, the first
    # piece's values lost): regions are claimed on the stepping thread
    store = opt._zero3_offload.store
    allocate = store.allocate

    def slow_allocate(nbytes):
        time.sleep(0.05)
        return allocate(nbytes)

    store.allocate = slow_allocate
    twin_opt = make(twin.parameters())
    steps = []
    for m, o in ((model, opt), (twin, twin_opt)):
        step = torch.compile(m, backend="zero3", options={"codegen": "eager"})
        losses = []
        for i in range(3):
            idx, targets = gpt_batch(2 * world, config, seed=i)
            mine = slice(2 * rank, 2 * rank + 2)
            loss = gpt_loss(step, (idx[mine], targets[mine]))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        steps.append(losses)
    params, twin_params = z3.full_state_dict(model), z3.full_state_dict(twin)
    state, twin_state = _full_optimizer_state(opt), _full_optimizer_state(twin_opt)
    resident_state = sum(
        v.to_local().untyped_storage().nbytes()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {
        "losses": steps,
        "params_equal": all(torch.equal(params[k], twin_params[k]) for k in twin_params),
        "state_equal": len(state) == len(twin_state)
        and all(torch.equal(a, b) for a, b in zip(state, twin_state)),
        "pieces": opt._zero3_offload.pieces_stepped,
        "resident_state": resident_state,
        "evicted": all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters()),
    }


def _spools(graph) -> bool:
    from zero3_compile.collectives.ops import SPOOL_GRAD

    return graph.kind == "backward" and any(n.target is SPOOL_GRAD for n in graph.gm.graph.nodes)


def _reads_outstanding(gm) -> int:
    """The most gather buckets whose shard reads a graph has issued and not all waited for."""
    from zero3_compile.collectives.ops import RELOAD
    from zero3_compile.compiler.node_keys import BUCKET

    outstanding: dict = {}  # bucket -> reads not waited yet
    most = 0
    for node in gm.graph.nodes:
        if node.target is RELOAD:
            bucket = node.meta[BUCKET]
            outstanding[bucket] = outstanding.get(bucket, 0) + 1
            most = max(most, len(outstanding))
        for read in node.all_input_nodes:
            if read.target is RELOAD:
                bucket = read.meta[BUCKET]
                outstanding[bucket] -= 1
                if outstanding[bucket] == 0:
                    del outstanding[bucket]
    return most


def reads_ahead(rank, world, depth):
    """Eight layers, a bucket each, shards on disk: how many buckets' reads are outstanding."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    z3.shard(model, offload=z3.Offload(params="disk"), sync_timeout_s=120)
    options = {"codegen": "eager", "bucket_mb": 0.001, "reload_depth": depth}
    step = torch.compile(model, backend="zero3", options=options)
    with z3.record_graphs() as graphs:
        step(torch.randn(4, 32)).sum().backward()
    return {g.kind: _reads_outstanding(g.gm) for g in graphs}


def checkpoint_roundtrip(rank, world, folder):
    """Offloaded model and optimizer saved with DCP, loaded into fresh offloaded ones, trained on:
    identical to a run without offload that never stopped."""
    torch.manual_seed(0)
    model, twin = GPT(), None
    twin = copy.deepcopy(model)
    z3.shard(model, offload=z3.Offload(params="disk"), sync_timeout_s=120)
    z3.shard(twin, sync_timeout_s=120)
    opt = z3.offload_optimizer(_optimizer("adamw", model.parameters()), tile_mb=0.05)
    twin_opt = _optimizer("adamw", twin.parameters())
    _train(rank, world, model, opt, "eager", 2, False)
    _train(rank, world, twin, twin_opt, "eager", 2, False)
    digest, read_back = hashing.file_digest, []

    def counted(path):  # what sealing reads back to hash it
        read_back.append(os.path.basename(path))
        return digest(path)

    hashing.file_digest = counted
    try:
        z3.save_checkpoint(folder, model, opt)
    finally:
        hashing.file_digest = digest
    torch.manual_seed(123)
    fresh = GPT()
    z3.shard(fresh, offload=z3.Offload(params="disk"), sync_timeout_s=120)
    fresh_opt = z3.offload_optimizer(_optimizer("adamw", fresh.parameters()), tile_mb=0.05)
    hashed_read, load_hashed = hashing.hashed_read, []

    def hashed(path, keep):  # what the load hashes, and whether it loads what it hashed
        load_hashed.append((os.path.basename(path), keep))
        return hashed_read(path, keep)

    hashing.hashed_read = hashed
    try:
        z3.load_checkpoint(folder, fresh, fresh_opt)
    finally:
        hashing.hashed_read = hashed_read
    losses = _train(rank, world, fresh, fresh_opt, "eager", 2, False, seed0=2)
    twin_losses = _train(rank, world, twin, twin_opt, "eager", 2, False, seed0=2)
    a, b = z3.full_state_dict(fresh), z3.full_state_dict(twin)
    # loads whose store writes fail on rank 0 (the loads write the offloaded values as they read
    # them): every rank raises, the trained model and optimizer keep what they had, a fresh
    # optimizer stays without state
    state = _full_optimizer_state(fresh_opt)
    blank = z3.shard(GPT(), offload=z3.Offload(params="disk"), sync_timeout_s=120)
    blank_opt = z3.offload_optimizer(_optimizer("adamw", blank.parameters()), tile_mb=0.05)
    blank_params = z3.full_state_dict(blank)
    original, errors = store_module.DiskStore._transfer, []

    def failing(self, tensor, offset, nbytes, write):
        if write and rank == 0:
            raise OSError(errno.EIO, "Input/output error (simulated)")
        return original(self, tensor, offset, nbytes, write)

    store_module.DiskStore._transfer = failing
    try:
        for target, target_opt in ((fresh, fresh_opt), (blank, blank_opt)):
            try:
                z3.load_checkpoint(folder, target, target_opt)
                errors.append("no error")
            except BaseException as failure:  # DCP's CheckpointException is one
                errors.append(str(failure))
    finally:
        store_module.DiskStore._transfer = original
    kept, blank_kept = z3.full_state_dict(fresh), z3.full_state_dict(blank)
    return {
        "tensor_files_read_back": [n for n in read_back if n.endswith(".distcp")],
        "load_hashed": [(n, keep) for n, keep in load_hashed if n.endswith(".distcp")],
        "losses_equal": losses == twin_losses,
        "params_equal": all(torch.equal(a[k], b[k]) for k in b),
        "failed_load_errors": errors,
        "failed_load_kept_params": all(torch.equal(a[k], kept[k]) for k in a),
        "failed_load_kept_state": all(
            torch.equal(x, y) for x, y in zip(state, _full_optimizer_state(fresh_opt), strict=True)
        ),
        "failed_load_blank_kept": all(torch.equal(blank_params[k], blank_kept[k]) for k in a),
        "failed_load_blank_stateless": not any(blank_opt.state.values()),
    }


def failed_step(rank, world):
    """An I/O error in the middle of step(): the previous parameters and optimizer state remain."""
    torch.manual_seed(0)
    model = z3.shard(GPT(), offload=z3.Offload(params="disk"), sync_timeout_s=120)
    opt = z3.offload_optimizer(_optimizer("sgd", model.parameters()), tile_mb=0.05)
    _train(rank, world, model, opt, "eager", 1, False)
    before, before_state = z3.full_state_dict(model), _full_optimizer_state(opt)
    idx, targets = gpt_batch(2 * world, seed=9)
    gpt_loss(model, (idx[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])).backward()
    original = store_module.DiskStore._transfer
    writes = {"n": 0}

    def failing(self, tensor, offset, nbytes, write):
        if write:
            writes["n"] += 1
            if writes["n"] == 5:
                raise OSError(errno.EIO, "Input/output error (simulated)")
        return original(self, tensor, offset, nbytes, write)

    store_module.DiskStore._transfer = failing
    try:
        opt.step()
        error = "no error"
    except OSError as failure:
        error = str(failure)
    finally:
        store_module.DiskStore._transfer = original
    after, after_state = z3.full_state_dict(model), _full_optimizer_state(opt)
    return {
        "error": error,
        "params_unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "state_unchanged": all(torch.equal(a, b) for a, b in zip(before_state, after_state)),
    }


def poison(rank, world, drop_waits):
    """Offload(poison=True): evicted and in-flight shards hold NaN until waited for."""
    module = importlib.import_module("zero3_compile.compiler.passes.lower_gathers")
    torch.manual_seed(0)
    model = GPT()
    twin = copy.deepcopy(model)
    z3.shard(model, offload=z3.Offload(params="disk", poison=True), sync_timeout_s=120)
    z3.shard(twin, sync_timeout_s=120)
    module._TEST_ONLY_DROP_RELOAD_WAITS = drop_waits
    try:
        options = {"codegen": "eager", "verify": not drop_waits}
        loss = gpt_loss(torch.compile(model, backend="zero3", options=options), gpt_batch(2))
        twin_loss = gpt_loss(twin, gpt_batch(2))
    finally:
        module._TEST_ONLY_DROP_RELOAD_WAITS = False
    return {"loss": loss.item(), "twin_loss": twin_loss.item()}


def bad_setups(rank, world, folder):
    out = {}
    blocked = os.path.join(folder, "file-not-folder")
    if rank == 0:
        open(blocked, "w").close()
    dist.barrier()
    path = blocked if rank == 1 else os.path.join(folder, "ok")  # only rank 1's path is bad
    try:
        z3.shard(nn.Linear(8, 8), offload=z3.Offload(params="disk", path=path))
        out["bad_path"] = "no error"
    except OSError as error:
        out["bad_path"] = str(error)
    try:
        z3.shard(nn.Linear(8, 8), offload=z3.Offload(params="cpu"))
        out["cpu_tier"] = "no error"
    except ValueError as error:
        out["cpu_tier"] = str(error)
    original = os.posix_fallocate

    def full_disk(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    os.posix_fallocate = full_disk if rank == 0 else original  # only rank 0's disk is full
    try:
        z3.shard(nn.Linear(8, 8), offload=z3.Offload(params="disk", path=folder))
        out["full_disk"] = "no error"
    except OSError as error:
        out["full_disk"] = str(error)
    finally:
        os.posix_fallocate = original
    return out


def _scenario(rank, world, name, *args):
    torch._dynamo.reset()
    return globals()[name](rank, world, *args)


CASES = [
    ("identical", "eager", "disk", None, "sgd"),
    ("identical", "eager", None, "disk", "adamw"),
    ("identical", "eager", "disk", "disk", "adamw"),
    ("identical", None, "disk", "disk", "adamw"),
    ("identical", "eager", "disk", "disk", "sgd", True),
    # gradients spooled too: clipped, accumulated both ways, a plain optimizer over them
    ("identical", "eager", "disk", "disk", "adamw", True, "disk", True),
    ("identical", "inductor", None, "disk", "sgd", "plain", "disk", True),
    ("failed_step",),
    ("reads_ahead", 1),
    ("reads_ahead", 3),
    ("poison", False),
    ("poison", True),
    ("pieces", "adamw", "disk"),
    ("pieces", "sgd", None),
    ("pieces", "subclass", None),
]


@functools.cache
def _results(folder: str):
    cases = CASES + [("checkpoint_roundtrip", os.path.join(folder, "ckpt")), ("bad_setups", folder)]
    return run_scenarios(_scenario, 2, cases, timeout=1500)


@pytest.fixture(scope="module")
def results():
    folder = tempfile.mkdtemp(prefix="zero3-offload-test-")
    folders = {"checkpoint_roundtrip": (os.path.join(folder, "ckpt"),), "bad_setups": (folder,)}
    try:
        yield lambda *case: _results(folder)[case + folders.get(case[0], ())]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "identical"], ids=str)
def test_offloaded_training_is_bit_identical(results, case):
    for r in results(*case):
        assert r["losses_equal"] and r["params_equal"] and r["state_equal"], r
        assert r["trained"]
        assert r["not_evicted"] == []  # every offloaded shard holds no memory between steps
        assert r["resident_state"] == 0  # nor does the offloaded optimizer state
        if case[2] and case[1] is not None:  # reads of offloaded shards one bucket ahead
            assert 1 <= r["reads_outstanding"] <= 2, r
        if len(case) > 6:  # Offload(grads=...): every gradient in the spool before each step,
            assert r["grads_spooled"], r
            # written by the backward itself (the compiled graph's or the eager reduction's),
            # not left in memory for the parameter's hook
            assert r["spooled_by_hook"] == 0, r
            left, twin_left = r["backward_end_bytes"]
            if case[1] is not None:  # the memory estimate counts no gradient held at the end
                assert left and all(b == 0 for b in left) and all(b > 0 for b in twin_left), r


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "subclass"])
def test_a_parameter_larger_than_a_tile_steps_in_pieces_bit_identically(results, optimizer):
    grads = "disk" if optimizer == "adamw" else None
    for r in results("pieces", optimizer, grads):
        losses, twin_losses = r["losses"]
        assert losses == twin_losses and losses[-1] != losses[0], r
        assert r["params_equal"] and r["state_equal"], r
        assert r["resident_state"] == 0 and r["evicted"], r
        if optimizer == "subclass":  # not known to be elementwise: stepped whole
            assert r["pieces"] == 0, r
        else:  # the embedding's 16384 elements per rank in 4 pieces, 3 steps
            assert r["pieces"] >= 12, r


@pytest.mark.parametrize("depth", [1, 3])
def test_offloaded_shards_are_read_reload_depth_buckets_ahead(results, depth):
    """Each bucket's reads start ``reload_depth`` buckets ahead of its gather, not all at the top
    of the graph (which held every offloaded shard in memory at once)."""
    for r in results("reads_ahead", depth):
        assert r["forward"] == r["backward"] == depth + 1, r


def test_checkpoint_of_an_offloaded_run_resumes_identically(results):
    """Also: the save hashes each tensor file as it writes it (the manifest's digests, which the
    load verifies as it reads each file), never reading the checkpoint back."""
    for r in results("checkpoint_roundtrip"):
        assert r["losses_equal"] and r["params_equal"]
        assert r["tensor_files_read_back"] == [], r
        # the load reads each of its tensor files once, hashing it as it loads it
        names = [n for n, _ in r["load_hashed"]]
        assert names and len(set(names)) == len(names), r["load_hashed"]
        assert all(keep for _, keep in r["load_hashed"]), r["load_hashed"]


def test_a_load_that_fails_writing_the_stores_keeps_the_previous_state(results):
    for r in results("checkpoint_roundtrip"):
        assert all("Input/output error" in e for e in r["failed_load_errors"]), r
        assert r["failed_load_kept_params"] and r["failed_load_kept_state"], r
        assert r["failed_load_blank_kept"] and r["failed_load_blank_stateless"], r


def test_failed_step_keeps_the_previous_training_state(results):
    for r in results("failed_step"):
        assert "Input/output error" in r["error"]
        assert r["params_unchanged"] and r["state_unchanged"]


def test_poison_mode_passes_with_waits_and_fails_without(results):
    for r in results("poison", False):
        assert r["loss"] == pytest.approx(r["twin_loss"], rel=1e-6)
    for r in results("poison", True):
        assert r["loss"] != r["loss"], r  # NaN: a read without its wait shows


def test_bad_setups_fail_clearly_on_every_rank(results):
    per_rank = results("bad_setups")
    for rank, r in enumerate(per_rank):
        if rank == 1:
            assert "cannot" in r["bad_path"] and "file-not-folder" in r["bad_path"], r
        else:
            assert "another rank could not set up its offload store" in r["bad_path"], r
        assert "Use Offload(params='disk')" in r["cpu_tier"]
        if rank == 0:
            assert "No space left" in r["full_disk"] and "bytes" in r["full_disk"], r
            assert "rank0.params.bin" in r["full_disk"]
        else:
            assert "another rank" in r["full_disk"], r


# ------------------------------------------------------------------------- memory and estimate


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


class Wide(nn.Module):
    """Big parameters, cheap compute: 4 x 2048^2 = 16.8M parameters (134 MB of AdamW state
    per rank at 2 ranks)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2048, 2048, bias=False) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _memory(rank, world, offloaded):
    import ctypes
    import gc

    from zero3_compile.offload import host_cache

    libc = ctypes.CDLL("libc.so.6")
    # a fixed mmap threshold (M_MMAP_THRESHOLD = -3): large blocks are mapped and unmapped, not
    # kept in glibc's arenas by its dynamic threshold, so RssAnon follows what is held
    libc.mallopt(-3, 64 * 1024)
    gc.collect()
    libc.malloc_trim(0)
    baseline = _rss_anon()  # what the process holds before the model (imports, process group)
    torch.manual_seed(0)
    model = Wide()
    grads = "disk" if offloaded == "grads" else None
    offload = z3.Offload(params="disk", grads=grads) if offloaded else None
    z3.shard(model, offload=offload, sync_timeout_s=120)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if offloaded:
        opt = z3.offload_optimizer(opt, tile_mb=16)
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    for _ in range(2):
        step(torch.randn(8, 2048)).backward()
        opt.step()
        # keep the gradient shards: resident unless offloaded (spooled zeros hold nothing)
        opt.zero_grad(set_to_none=False)
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    estimate = z3.estimate_memory(Wide(), world, optimizer="adamw")
    resident = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    resident += sum(
        0 if spooled(p) is not None else p.grad.to_local().untyped_storage().nbytes()
        for p in model.parameters()
    )
    resident += sum(
        v.to_local().untyped_storage().nbytes()
        for s in opt.state.values()
        for k, v in s.items()
        if k != "step"
    )
    gc.collect()
    # memory freed by torch goes back to glibc's arenas (the offload's I/O threads allocate in
    # their own) and, for blocks of 1 MiB and more, to the host cache the disk store installed
    # (within the most ever in use); hand both back to the system before reading what is resident
    libc.malloc_trim(0)
    host_cache.trim()
    return {
        "rss_anon": _rss_anon() - baseline,
        # parameters + exp_avg + exp_avg_sq (+ gradients)
        "offloaded_bytes": (4 if grads else 3) * shard if offloaded else 0,
        "resident": resident,
        "estimate": {row.setting: row.resident for row in estimate.rows},
    }


@functools.cache
def memory_runs():
    return tuple(run_ranks(_memory, 2, how, timeout=600) for how in (False, True, "grads"))


@pytest.mark.parametrize("how", ["params + optimizer", "params + grads + optimizer"])
def test_offload_frees_at_least_80_percent_of_the_offloaded_bytes_of_resident_memory(how):
    plain, *offloaded_runs = memory_runs()
    offloaded = offloaded_runs[0 if how == "params + optimizer" else 1]
    for rank in range(2):
        saved = plain[rank]["rss_anon"] - offloaded[rank]["rss_anon"]
        wanted = offloaded[rank]["offloaded_bytes"]
        assert wanted > 90e6
        assert saved >= 0.8 * wanted, (saved / 2**20, wanted / 2**20)


_FIRST_STEP = """
import ctypes, json, tempfile, torch
import zero3_compile as z3

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

params = [torch.nn.Parameter(torch.randn(48 * 2**20)) for _ in range(2)]
for p in params:
    p.grad = torch.randn_like(p)
opt = z3.offload_optimizer(torch.optim.AdamW(params), tier="disk", path=tempfile.mkdtemp())
# where glibc serves a 16 MiB tensor once a freed 24 MiB mapping has moved its threshold: from
# the heap (where a small tensor allocated next splits its hole when it is freed) or from a
# mapping of its own (returned to the system when freed)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
x = torch.empty(6 * 2**20)
del x
mapped = libc.mallinfo2().hblkhd
big = torch.empty(4 * 2**20)
mapped = libc.mallinfo2().hblkhd - mapped
del big
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
opt.step()
off = opt._zero3_offload
from zero3_compile.offload import host_cache
print(json.dumps({"rise": status("VmHWM") - before, "pieces": off.pieces_stepped,
                  "slots": off.slots, "piece": 48 * 2**20 * 4 // (off.pieces_stepped // 2),
                  "mapped": mapped, "cache": host_cache.stats()}))
"""


def _allocator_env(**settings: str) -> dict[str, str]:
    """This environment without the user's own glibc threshold settings, plus ``settings``."""
    glibc_own = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
    return {k: v for k, v in os.environ.items() if k not in glibc_own} | settings


def _python_all(code: str, envs: dict) -> dict:
    """``python -c code`` in each environment of ``envs`` (name: environment), all started at
    once (each spends seconds importing torch); name: the finished process (returncode, stdout,
    stderr)."""
    import subprocess
    import sys

    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, env in envs.items()
    }
    done = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return done


def test_the_first_offloaded_step_gives_freed_host_memory_back():
    """The first step creates each piece's optimizer state (two 19 MiB tensors that live until
    the piece is written) between small tensors that live on. Under glibc's moving mmap
    threshold every freed piece left a hole the small ones split, and resident memory rose by
    the state of every piece (5.4 GB per rank at 3B); with the threshold the disk store fixes,
    by what the pieces in flight hold. ``ZERO3_MMAP_THRESHOLD=0`` (glibc's default) is the
    control."""
    import json
    import subprocess
    import sys

    def run(threshold, cache_mb="0"):
        env = _allocator_env(ZERO3_MMAP_THRESHOLD=threshold, ZERO3_HOST_CACHE_MB=cache_mb)
        out = subprocess.run(
            [sys.executable, "-c", _FIRST_STEP], capture_output=True, text=True, env=env,
            timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    # glibc alone (the host cache off), then with the host cache the store also installs
    fixed, control, cached = run(""), run("0"), run("", cache_mb="")
    assert fixed["pieces"] == control["pieces"] == cached["pieces"] == 20
    # at most the pieces in memory at once (stepping, read ahead, writes behind), each with its
    # new exp_avg and exp_avg_sq, and 32 MiB of anything else
    bound = fixed["slots"] * 2 * fixed["piece"] + 32 * 2**20
    assert fixed["rise"] <= bound, (fixed["rise"] / 2**20, bound / 2**20)
    # the cache keeps freed pieces for the next ones, within the high-water mark of those in use
    assert cached["rise"] <= bound, (cached["rise"] / 2**20, bound / 2**20)
    assert cached["cache"]["hits"] > 0, cached
    # why (the step's own rise under glibc's default depends on its threads' timing: 117 to
    # 610 MiB measured): glibc serves 16 MiB from the heap by default, from a mapping of its
    # own once the disk store fixed the threshold
    assert control["mapped"] == 0, control
    assert fixed["mapped"] >= 16 * 2**20, fixed


def test_a_threshold_the_user_gave_glibc_stands():
    code = "from zero3_compile.offload.allocator import settle_host_allocator as s; print(s())"
    settings = {
        "default": {},
        "malloc env": {"MALLOC_MMAP_THRESHOLD_": "65536"},
        "tunables": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
        "ours": {"ZERO3_MMAP_THRESHOLD": str(2**20)},
        "off": {"ZERO3_MMAP_THRESHOLD": "0"},
    }
    envs = {name: _allocator_env(**env) for name, env in settings.items()}
    settled = {}
    for name, out in _python_all(code, envs).items():
        assert out.returncode == 0, out.stderr
        settled[name] = int(out.stdout.split()[-1])
    assert settled == {
        "default": 8 * 2**20, "malloc env": 0, "tunables": 0, "ours": 2**20, "off": 0
    }, settled  # fmt: skip


def test_memory_estimate_within_5_percent_of_what_the_run_holds():
    plain, offloaded, spooled_too = memory_runs()
    for run, setting in (
        (plain, "ZeRO-3"),
        (offloaded, "ZeRO-3, params + optimizer offloaded"),
        (spooled_too, "ZeRO-3, params + grads + optimizer offloaded"),
    ):
        for r in run:
            estimated = r["estimate"][setting]
            assert abs(estimated - r["resident"]) <= 0.05 * max(r["resident"], 1), (setting, r)


def test_estimate_command_prints_the_7b_table():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "zero3_compile.estimate", "--model", "llama-7b", "--world", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "6.74B parameters" in out.stdout
    assert (
        "data parallel (DDP)                       26.95     26.95      53.91    107.81"
        in out.stdout
    )
    assert (
        "ZeRO-3                                     6.74      6.74      13.48     26.95"
        in out.stdout
    )
    assert "16 bytes per parameter" in out.stdout


def test_offload_files_are_unlinked_while_open(tmp_path):
    """A finished, failed or killed run leaves no swap file: the file has no name once open."""
    from zero3_compile.offload.store import DiskStore

    store = DiskStore(str(tmp_path), "params", 0)
    region = store.allocate(4096)
    data = torch.arange(1024, dtype=torch.float32)
    store.write_current(region, data)
    back = torch.empty_like(data)
    store.read(region, back)
    assert torch.equal(back, data)
    assert os.listdir(tmp_path) == []
    private = DiskStore(None, "optimizer", 0)  # the default folder is gone as well
    assert not os.path.exists(os.path.dirname(private.path))
    store.close()
    private.close()


def test_to_on_an_offloaded_model_leaves_its_shards_or_refuses_by_name(fake_pg):
    """``model.to("cpu:0")`` (the Hugging Face Trainer's move) read the evicted shards' missing
    memory and crashed the process; now a no-op move leaves them in the store, and a cast or a
    move names the parameter and the fix."""
    model = GPT(GPTConfig())
    z3.shard(model, offload=z3.Offload(params="disk"))
    params = list(model.parameters())
    evicted = [p.to_local().untyped_storage().nbytes() == 0 for p in params]
    assert all(evicted)
    model.to("cpu:0")
    model.to(torch.float32)
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters())
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    with pytest.raises(RuntimeError, match=r"offloaded .* torch.bfloat16 .* before zero3.shard"):
        model.to(torch.bfloat16)
    state = z3.full_state_dict(model)  # the values are still read from the store
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in state.values())


def test_o_direct_moves_aligned_tensors_without_a_staging_copy(tmp_path, monkeypatch):
    """With ``o_direct=True`` a tensor at an aligned address (``aligned_empty``: the optimizer's
    staging pool, reloaded shards) is read and written straight from its memory, a tail shorter
    than a block and an unaligned tensor through the staging buffers; the values round-trip
    either way, whole and in parts."""
    from zero3_compile.offload.store import DiskStore, aligned_empty

    store = DiskStore(str(tmp_path), "optimizer", 0, o_direct=True)
    assert store.o_direct, "this folder's file system refuses O_DIRECT"
    staged = []
    plain_staged = store._staged
    monkeypatch.setattr(
        store, "_staged", lambda flat, *a: staged.append(flat.numel()) or plain_staged(flat, *a)
    )
    gen = torch.Generator().manual_seed(0)
    for numel, aligned in ((3 * 1024, True), (3 * 1024 + 25, True), (3 * 1024, False)):
        data = torch.randn(numel, generator=gen)
        region = store.allocate(numel * 4)
        if aligned:
            source = aligned_empty((numel,), torch.float32).copy_(data)
        else:
            source = torch.empty(numel + 1)[1:].copy_(data)  # 4 bytes past an aligned start
            assert source.data_ptr() % 4096
        staged.clear()
        store.write_current(region, source)
        back = aligned_empty((numel,), torch.float32) if aligned else torch.empty(numel + 1)[1:]
        back.zero_()
        store.read(region, back)
        assert torch.equal(back, data), numel
        tail = numel * 4 % 4096
        assert staged == ([tail, tail] if tail else []) if aligned else [numel * 4] * 2, staged
    # parts at block boundaries, as the optimizer's pieces are
    region = store.allocate(8 * 4096)
    whole = torch.randn(8 * 1024, generator=gen)
    staged.clear()
    for start in range(0, 8 * 1024, 2048):
        piece = aligned_empty((2048,), torch.float32).copy_(whole[start : start + 2048])
        store.write_part(region, piece, start * 4)
    region.commit()
    back = aligned_empty((2048,), torch.float32)
    store.read_part(region, back, 4096 * 4)
    assert torch.equal(back, whole[4096:6144]) and staged == []
    store.close()


@pytest.mark.parametrize("slots", [2, 1])
def test_a_region_left_in_a_file_reads_its_rows_cast_until_a_new_version_is_committed(
    tmp_path, slots
):
    from zero3_compile.offload.deferred import StoredTensor
    from zero3_compile.offload.store import DiskStore, FileRows, OffloadError

    values = torch.randn(3 * 4096, dtype=torch.float32).to(torch.bfloat16)
    path = str(tmp_path / "checkpoint.bin")
    with open(path, "wb") as f:
        f.write(b"header!")  # rows at an unaligned offset, as in a safetensors file
        f.write(values.view(torch.uint8).numpy().tobytes())
    store = DiskStore(str(tmp_path), "params", 0, double_buffer=slots == 2)
    region = store.allocate(values.numel() * 4)
    identity = store_module.file_identity(os.stat(path))
    file = store.source_file(path, identity)
    store.leave_in_file(region, FileRows(file, 7, torch.bfloat16, torch.float32))
    assert store.bytes_written == 0
    whole = torch.empty(values.numel())
    store.read(region, whole)
    assert torch.equal(whole, values.float())
    part = torch.empty(4096)
    store.read_part(region, part, 4096 * 4)  # the second 4096 elements
    assert torch.equal(part, values[4096:8192].float())
    later = torch.empty(values.numel())
    store.read_async(region, later).result()
    assert torch.equal(later, values.float())
    handed_out = StoredTensor(store, region, (values.numel(),), torch.float32, "cpu")
    # a version written and discarded: the file's rows are still the values (one slot too)
    store.write(region, torch.zeros(values.numel()))
    region.discard()
    assert not region.lost and region.source is not None
    store.read(region, whole)
    assert torch.equal(whole, values.float())
    # a committed version replaces them: the file is not read again
    store.write(region, torch.full((values.numel(),), 2.0))
    region.commit()
    assert region.source is None
    store.read(region, whole)
    assert torch.equal(whole, torch.full((values.numel(),), 2.0))
    # rewritten in place: what was handed out before refuses to read it, naming the fix
    with open(path, "r+b") as f:
        f.seek(7)
        f.write(b"\0\0")
    with pytest.raises(OffloadError, match="changed after it was loaded"):
        handed_out.materialize()
    # a file at that path that is not the one read is not used
    os.replace(path, path + ".old")
    with open(path, "wb") as f:
        f.write(b"header!" + values.view(torch.uint8).numpy().tobytes())
    assert store.source_file(path, identity) is file  # the descriptor it holds
    assert store.source_file(path, store_module.file_identity(os.stat(path + ".old"))) is None
    store.close()


# --------------------------------------------------------- a few hundred MB, resumed in new processes

WIDE_STEPS = 2


def _wide_run(rank, world, folder, resume):
    """Wide (5 layers: 21M parameters, 252 MB of fp32 parameters + AdamW moments) with
    parameters and optimizer state on disk: ``resume=False`` trains WIDE_STEPS steps, saves, and
    takes one more; ``resume=True`` (new processes) loads the checkpoint and takes that step."""
    torch.manual_seed(0)
    model = Wide()
    model.layers.append(nn.Linear(2048, 2048, bias=False))
    scratch = os.path.join(folder, f"offload-{rank}-{int(resume)}")
    z3.shard(model, offload=z3.Offload(params="disk", path=scratch), sync_timeout_s=120)
    opt = z3.offload_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), tier="disk", path=scratch, tile_mb=8
    )
    step = torch.compile(model, backend="zero3", options={"codegen": "eager"})

    def train(i):
        x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(100 * i + rank))
        loss = step(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    ckpt = os.path.join(folder, "checkpoint")
    load = None
    if resume:
        param_store = offloaded_states(model)[0].offload.store
        stores = {id(s): s for s in (param_store, opt._zero3_offload.store)}
        before = [(s.bytes_read, s.bytes_written) for s in stores.values()]
        peak = _peak_growth(lambda: z3.load_checkpoint(ckpt, model, opt))
        after = [(s.bytes_read, s.bytes_written) for s in stores.values()]
        load = {
            "peak": peak,
            "read": sum(a[0] - b[0] for a, b in zip(after, before)),
            "written": sum(a[1] - b[1] for a, b in zip(after, before)),
        }
    else:
        for i in range(WIDE_STEPS):
            train(i)
        save_peak = _peak_growth(lambda: z3.save_checkpoint(ckpt, model, opt))
    loss = train(WIDE_STEPS)
    full = z3.full_state_dict(model)
    state = _full_optimizer_state(opt)
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {
        "loss": loss,
        "params": full,
        "state": state,
        "state_bytes": 3 * shard_bytes * world,
        "save_peak": None if resume else save_peak,
        "load": load,
    }


def _peak_growth(fn) -> int:
    """How far the process's resident memory rose above where it was while ``fn`` ran."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    before = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - before) * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def _run_then_resume(fn, timeout: float) -> tuple[list, list]:
    """``fn(rank, world, folder, resume)`` on 2 ranks, then again in new processes with
    ``resume=True``, in a folder deleted afterwards."""
    folder = tempfile.mkdtemp(prefix="zero3-offload-resume-")
    try:
        first = run_ranks(fn, 2, folder, False, timeout=timeout)
        return first, run_ranks(fn, 2, folder, True, timeout=timeout)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_250_mb_offloaded_resume_in_new_processes_bit_identically():
    first, resumed = _run_then_resume(_wide_run, timeout=600)
    assert first[0]["state_bytes"] >= 250e6
    for r in first:  # the save reads each offloaded tensor right before writing it
        # (measured 41-57 MiB of 120 MiB of offloaded state per rank: a few of the 8 MiB tensors
        # and DCP's own buffers under glibc's default allocator; 129 MiB when it read them all)
        own_state = r["state_bytes"] / 2
        assert r["save_peak"] <= 0.6 * own_state, (r["save_peak"] / 2**20, own_state / 2**20)
    for r in resumed:  # the load writes each offloaded value to its store as DCP reads it: it
        # reads nothing from the stores (no step to create the optimizer's state, no current
        # values read to be overwritten), writes each value once, and holds a few tensors: the
        # file it parses, the one read ahead, the values DCP parsed, the buffer being written
        # (measured: 54 MiB of 120 MiB of 8 MiB tensors; before, it held the whole state: 184
        # MiB, and read 200 MiB from the stores and wrote 240)
        own_state = r["state_bytes"] / 2
        assert r["load"]["read"] == 0
        assert r["load"]["written"] == own_state
        assert r["load"]["peak"] <= 0.6 * own_state, (r["load"]["peak"] / 2**20, own_state / 2**20)
    for a, b in zip(first, resumed):
        assert a["loss"] == b["loss"]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert len(a["state"]) == len(b["state"]) > 0
        assert all(torch.equal(x, y) for x, y in zip(a["state"], b["state"]))


def _one_big_tensor(rank, world, folder, load):
    """A model whose one offloaded weight shard (64 MiB per rank) is most of its checkpoint
    file: saved (``load=False``), or loaded into a fresh offloaded model in new processes
    (``load=True``): how far the load's memory rose, and the values it loaded."""
    torch.manual_seed(0 if not load else 1)
    model = nn.Linear(4096, 8192, bias=False)
    scratch = os.path.join(folder, f"offload-{rank}-{int(load)}")
    z3.shard(model, offload=z3.Offload(params="disk", path=scratch), sync_timeout_s=120)
    ckpt = os.path.join(folder, "checkpoint")
    peak = None
    if load:
        peak = _peak_growth(lambda: z3.load_checkpoint(ckpt, model))
    else:
        z3.save_checkpoint(ckpt, model)
    largest_file = max(
        os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt) if n.endswith(".distcp")
    )
    return {
        "peak": peak,
        "shard_bytes": 4096 * 8192 * 4 // world,
        "largest_file": largest_file,
        "weight": z3.full_state_dict(model)["weight"],
    }


def test_a_checkpoint_load_holds_no_file_whole():
    """A file larger than ``_READ_WHOLE_MAX`` is parsed while a thread hashes it beside the
    parse: the load holds the item DCP parsed and the buffer being written to the store (2x
    the shard: measured 135 MiB for a 64 MiB shard), not the file too (3x: 195 MiB when every
    file was read whole to be checked before the parse)."""
    saved, loaded = _run_then_resume(_one_big_tensor, timeout=300)
    for s, r in zip(saved, loaded):
        assert torch.equal(s["weight"], r["weight"])
        assert r["largest_file"] > max(r["shard_bytes"], reader.READ_WHOLE_MAX)
        assert r["peak"] <= 2.5 * r["shard_bytes"], (r["peak"] / 2**20, r["shard_bytes"] / 2**20)


_HOST_CACHE = """
import json, os, resource, torch
from zero3_compile.offload import host_cache

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def fill(numel):  # a block touched page by page, as a step's casts and collectives do
    t = torch.empty(numel)
    t.fill_(1.0)
    return t

out = {}
glibc = fill(2**24)  # 64 MiB under glibc (before the cache): mapped afresh each time
del glibc
before = faults()
del_me = fill(2**24)
del del_me
out["glibc_faults"] = faults() - before

out["installed"] = host_cache.install(cap_bytes=256 * 2**20)
first = fill(2**24)
ptr = first.data_ptr()
del first
before = faults()
second = fill(2**24)  # the freed block again: no fresh pages
out["cached_faults"] = faults() - before
out["same_block"] = second.data_ptr() == ptr
out["values"] = float(second.sum())
del second
out["after_reuse"] = host_cache.stats()
small = torch.empty(1000)  # below 1 MiB: the allocator the cache replaced
out["after_small"] = host_cache.stats()
# a request of another size class gives kept blocks back first: kept + in use never exceed the
# most ever in use
other = fill(2**23)
out["after_other"] = host_cache.stats()
del other
# the cap: three blocks in use at once, then freed; at most 64 MiB stay kept
host_cache.install(cap_bytes=64 * 2**20)
blocks = [fill(2**23 + i * 2**20) for i in range(3)]
del blocks
out["capped"] = host_cache.stats()
# oneDNN's matmuls take scratch memory through torch's raw interface (one deleter for all)
m = torch.randn(1024, 1024)
exact = m @ m
for _ in range(2):
    close = torch.allclose((m.bfloat16() @ m.bfloat16()).float(), exact, rtol=0.05, atol=2.0)
    out["matmul"] = bool(close) and bool(torch.equal(m @ m, exact))
pid = os.fork()  # a child (a DataLoader's worker) allocates through its copy of the cache
if pid == 0:
    torch.set_num_threads(1)  # as a DataLoader's workers do (OpenMP's pool is not forked)
    os._exit(0 if float(fill(2**24).sum()) == 2**24 else 1)
out["child_exit"] = os.waitpid(pid, 0)[1]
kept_through = fill(2**24)  # handed out before the uninstall, freed after it
host_cache.uninstall()
out["uninstalled"] = host_cache.stats()
del kept_through  # goes back to the system, not into the cache
after = torch.empty(2**24)
out["after_uninstall"] = host_cache.stats()
print(json.dumps(out))
"""


def test_the_host_cache_reuses_freed_blocks_within_its_high_water_and_cap(tmp_path):
    """Large host tensors reuse freed blocks (no page faults the second time), values intact;
    small ones stay with glibc; what the cache keeps and holds in use together never exceeds the
    most it held in use, nor the cap; oneDNN's raw allocations and a forked child work."""
    import json
    import subprocess
    import sys

    env = _allocator_env(ZERO3_HOST_CACHE_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", _HOST_CACHE], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["installed"] is True and got["matmul"] is True
    pages = 2**24 * 4 // 4096
    assert got["glibc_faults"] >= 0.9 * pages, got  # the control: every page faults
    assert got["cached_faults"] < 0.05 * pages, got
    assert got["same_block"] and got["values"] == 2**24
    reuse = got["after_reuse"]
    assert (reuse["hits"], reuse["misses"], reuse["live_bytes"]) == (1, 1, 0), reuse
    assert reuse["kept_bytes"] == 2**26
    assert got["after_small"] == reuse  # not through the cache
    other = got["after_other"]
    assert other["misses"] == 2 and other["kept_bytes"] + other["live_bytes"] <= 2**26, other
    capped = got["capped"]
    assert capped["kept_bytes"] <= 64 * 2**20 and capped["released"] >= 2, capped
    assert got["child_exit"] == 0
    assert got["uninstalled"]["kept_bytes"] == 0
    done = got["after_uninstall"]
    assert done["misses"] == got["uninstalled"]["misses"] and done["kept_bytes"] == 0, done
    assert done["released"] == got["uninstalled"]["released"] + 1
    assert done["live_bytes"] == got["uninstalled"]["live_bytes"] - 2**26
    assert list(tmp_path.glob("host_cache-*.so")), "built into ZERO3_HOST_CACHE_DIR"


def test_the_disk_store_installs_the_host_cache_unless_told_not_to(tmp_path):
    code = (
        "import torch, tempfile; from zero3_compile.offload import host_cache;"
        "from zero3_compile.offload.allocator import settle_host_allocator as s; s();"
        "print(host_cache.installed())"
    )
    envs = {
        name: _allocator_env(ZERO3_HOST_CACHE_DIR=str(tmp_path), ZERO3_HOST_CACHE_MB=cap)
        for name, cap in (("default", ""), ("off", "0"))
    }
    envs["bad"] = _allocator_env(ZERO3_HOST_CACHE_MB="lots")
    done = _python_all(code, envs)
    seen = {}
    for name in ("default", "off"):
        out = done[name]
        assert out.returncode == 0, out.stderr
        seen[name] = out.stdout.split()[-1]
    assert seen == {"default": "True", "off": "False"}, seen
    out = done["bad"]
    assert out.returncode != 0 and "ZERO3_HOST_CACHE_MB='lots'" in out.stderr, out.stderr
