"""``save_checkpoint``, ``load_checkpoint``, ``load_rank_state``, ``verify_checkpoint``: the
collective calls, wiring the package's parts (see ``__init__``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_state_dict,
)

from ..._torch.checkpoint import no_optimizer_state_init
from ...offload.deferred import holds_deferred
from ...offload.incoming import IncomingWrites, incoming
from ..stages import StageModules, is_flattened
from .durable import existing, remove_stale_staging, seal
from .hashing import HashingFileSystem
from .manifest import checked_manifest, corrupt, read_manifest
from .peers import next_call, raise_if_peer_lost
from .reader import (
    IncomingPlanner,
    IncomingReader,
    raise_if_corrupt,
    read_rank_state,
    verifies_on_read,
)
from .state import ReadingPlanner, shard_access, state_dicts, without_optimizer_state

_SAVE_THREADS = 2  # writer threads of a save of offloaded values (two tensors held at a time)


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module | list[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, torch.Tensor] | None = None,
    rank_state: Any = None,
) -> None:
    """Save ``model`` (and ``optimizer``) shards to the directory ``path``; every rank must call it.

    ``model`` may be a list: the pipeline stage modules this rank runs, holding their parameters
    under the whole model's names (stages cut from the model with its module names kept, as
    torchtitan does); the checkpoint then holds the whole model, and loads at another pipeline,
    data- or tensor-parallel degree, or into the unsharded model. The optimizer state is stored
    per parameter (torchtitan's layout), so a checkpoint of the whole model loads into pipeline
    stages as well.

    The checkpoint is written to ``path.tmp-<id>`` first and sealed with a manifest of every
    file's size and sha256; once every rank has finished, rank 0 renames it to ``path`` (moving the
    previous checkpoint aside first and deleting it last). ``extra``: tensors saved as rank 0 has
    them. ``rank_state``: this rank's own objects (tensors, numbers, strings, None and
    lists/tuples/dicts of them), returned by ``load_checkpoint`` on the same rank.

    It leaves the model and optimizer as they are (an optimizer that has not stepped yet keeps
    no state); inside a gradient-sync-off window it saves the shards and optimizer state, without
    the gradients pending for the next step.

    Example:
        ```python
        z3.save_checkpoint("ckpt/step-100", model, opt, rank_state={"step": 100})
        ```
    """
    path = os.fspath(path)
    call = next_call("save")
    # optimizer state per parameter (stages.py): loads into any cut of the model into stages
    state = state_dicts(StageModules(model, flatten=True), optimizer, for_save=True)
    if extra:
        state["extra"] = dict(extra)
    rank = dist.get_rank()
    staging = None
    try:
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        save_id = token[0]
        staging = f"{path}.tmp-{save_id}"
        if rank == 0:
            remove_stale_staging(path, keep=staging)
        # torch's writer keeps every tensor of a file alive until the file is closed: offloaded
        # values, read as they are written, go one tensor per file so one is held at a time by
        # each of two writer threads (one's read from the store overlaps the other's write).
        # No fsync per file as it is written (a wait on the disk each): sealing fsyncs them all
        # before the manifest names them
        deferred = holds_deferred(state)
        writer = FileSystemWriter(
            staging,
            single_file_per_rank=not deferred,
            thread_count=_SAVE_THREADS if deferred else 1,
            sync_files=False,
        )
        writer.fs = hashing = HashingFileSystem()  # the manifest's digests, as bytes go out
        dcp.save(state, storage_writer=writer, planner=ReadingPlanner())
        seal(staging, path, save_id, rank_state, hashing.digests)
    except BaseException as error:
        # every rank has failed (DCP and the exchanges report a failure everywhere) or a peer is
        # gone; rank 0 owns the staging directory. The checkpoint at ``path`` is untouched.
        if rank == 0 and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise_if_peer_lost(
            error,
            call,
            f"save_checkpoint({path!r})",
            f"The checkpoint at {path!r} is the previous one, or this save complete (saves are "
            "swapped in atomically).",
        )
        raise


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module | list[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, torch.Tensor] | None = None,
    verify: bool = True,
) -> Any:
    """Load a checkpoint written by ``save_checkpoint`` (at any world size) into ``model`` and
    ``optimizer``.

    The files are checked against the checkpoint's manifest (as they are read, or all first:
    see the package docstring); a damaged one raises ``CheckpointCorruptError`` on every rank and
    nothing is loaded. ``verify=False`` skips that, for checkpoints written without one.
    ``extra`` receives, in place, the tensors saved under the same keys. Returns the
    ``rank_state`` this rank saved (None if the rank saved none, e.g. the checkpoint was written
    at a smaller world size).

    Example:
        ```python
        state = z3.load_checkpoint("ckpt/step_100", model, opt)  # at any world size
        step = state["step"]
        ```
    """
    path = existing(os.fspath(path))
    call = next_call("load")
    writes = IncomingWrites()  # offloaded values go from the checkpoint to their stores
    offloaded = getattr(optimizer, "_zero3_offload", None)
    created: list = []
    staged: list | None = None  # (in-memory destination, values read), copied in at the end
    try:  # the collective part: every rank fails alike here, or a peer is gone
        # every file there with its size; what is in them is checked as it is read
        manifest = checked_manifest(path, contents=False) if verify else None
        reader = IncomingReader(path, writes, manifest)
        # the optimizer state's layout is the checkpoint's (stages.py), whatever model is given
        metadata = reader.read_metadata()
        flattened = is_flattened(metadata)
        # saved before the optimizer's first step: its parameter groups only, no state
        unstepped = optimizer is not None and flattened and without_optimizer_state(metadata)
        stages = StageModules(model, flatten=flattened)
        if stages.prefixed and optimizer is not None and not flattened:
            raise ValueError(
                f"zero3: the checkpoint at {path!r} was saved from one module, with the "
                "optimizer state by parameter group; load it into one module (the whole model), "
                "not a list of pipeline stage modules"
            )
        if offloaded is not None and not unstepped:
            created = offloaded.prepare_load()
        state = state_dicts(stages, optimizer, unstepped=unstepped)
        if extra:
            state["extra"] = dict(extra)
        if manifest is not None:
            if verifies_on_read(state):
                staged = []
            else:  # the in-memory values too large to hold twice: every file verified first
                reader.fs.verifying = False
                checked_manifest(path, contents=True)
        dcp.load(state, storage_reader=reader, planner=IncomingPlanner(writes, staged))
    except BaseException as error:
        writes.discard()
        if created:
            offloaded.abandon_load(created)
        raise_if_corrupt(error, path)
        raise_if_peer_lost(error, call, f"load_checkpoint({path!r})", "Nothing was loaded.")
        _raise_if_mismatched(error, path)
        raise
    # every rank read everything, every file it read as saved: the values become current
    writes.commit()
    for target, values in staged or ():
        target.copy_(values)
    loaded_state = stages.root_state(state)
    # the model's offloaded shards are in their stores already; the rest is set as usual
    model_state = {k: v for k, v in loaded_state["model"].items() if incoming(v) is None}
    options = stages.options or StateDictOptions()
    if len(model_state) < len(loaded_state["model"]):
        options = dataclasses.replace(options, strict=False)  # DCP found every key
    if unstepped and optimizer.state:
        if offloaded is not None:
            raise ValueError(
                f"zero3: the checkpoint at {path!r} was saved before the optimizer's first step "
                "(it holds no optimizer state); load it into an offloaded optimizer that has not "
                "stepped yet (a new one), or without the optimizer"
            )
        optimizer.state.clear()  # as saved: no state
    with shard_access(stages), no_optimizer_state_init(unstepped):
        if optimizer is not None:
            set_state_dict(
                stages.root,
                optimizer,
                model_state_dict=model_state,
                optim_state_dict=loaded_state["optim"],
                options=options,
            )
        else:
            set_model_state_dict(stages.root, model_state, options=options)
    if extra:
        for key, value in state["extra"].items():
            if extra[key] is not value:
                extra[key].copy_(value)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return read_rank_state(path, rank, manifest, verify_file=staged is not None)


def load_rank_state(path: str | os.PathLike, rank: int, *, verify: bool = True) -> Any:
    """The ``rank_state`` that ``rank`` saved into the checkpoint at ``path`` (None if it saved
    none); not collective. With ``verify``, that file is checked against the manifest.

    Example:
        ```python
        state = z3.load_rank_state("ckpt/step_100", rank=0)  # one rank's, no collective
        ```
    """
    path = existing(os.fspath(path))
    manifest = None
    if verify:
        manifest, problems = read_manifest(path)
        if problems:
            raise corrupt(path, problems)
    return read_rank_state(path, rank, manifest, verify_file=verify)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check every file of the checkpoint at ``path`` against its manifest; return the manifest.

    Raises ``CheckpointCorruptError`` naming each missing, truncated or modified file, or a
    missing or damaged manifest. With ``torch.distributed`` initialised this is collective: each
    rank hashes a share of the files and every rank raises the same error.

    Example:
        ```python
        manifest = z3.verify_checkpoint("ckpt/step_100")  # raises CheckpointCorruptError
        ```
    """
    return checked_manifest(existing(os.fspath(path)), contents=True)


def _raise_if_mismatched(error: BaseException, path: str) -> None:
    """DCP's planning errors (another model's checkpoint: sizes or keys that do not match),
    raised by it on every rank, as a ValueError that says what to do."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, CheckpointException):
        return
    failures = getattr(error, "failures", {}) or {}
    reasons = sorted({str(f).strip().splitlines()[-1] for f in failures.values()}) or [str(error)]
    planning = [r for r in reasons if "mismatch" in r.lower() or "missing" in r.lower()]
    if not planning:
        return
    raise ValueError(
        f"zero3: the checkpoint at {path!r} does not fit this model: {'; '.join(planning[:3])}. "
        "Load it into the model (and optimizer) it was saved from; nothing was loaded."
    ) from error
