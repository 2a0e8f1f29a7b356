"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, sealed saves; verified,
safe loads.

``save_checkpoint(path, model, optimizer)`` writes every rank's shards of the model and optimizer
state (keys are parameter names, as ``get_state_dict`` gives them) into a fresh directory
``path.tmp-<save id>``. Each rank then fsyncs and records the size and sha256 of every file it
wrote there (its ``__<rank>_*.distcp`` shards, hashed as the writer wrote them; its ``rank_state``
file; rank 0 also DCP's ``.metadata``, those two read back), rank 0 merges the records into
``zero3_manifest.json`` (with the save id and a checksum of the manifest itself), and only then
is the directory swapped in for ``path``: an interrupted save (a full disk, a killed rank) leaves
the previous checkpoint intact and loadable.

``load_checkpoint`` checks the checkpoint against the manifest: every file present with its size
first, then each file's sha256 as it reads it (a file up to ``_READ_WHOLE_MAX`` read whole into
memory, hashed on the way, checked before DCP parses it; a larger one hashed on a thread while DCP
parses its items and checked when DCP closes it, a parse that failed on it reported as the
damage), and nothing becomes the model's until every rank read everything and every file it read
was intact: offloaded values are written to their stores' free slots, committed at the end
(``offload/incoming.py``); the values it loads into memory wait in buffers until then. A load
that cannot hold its in-memory values twice hashes every file first (the ranks share the hashing)
and reads them again to load them. Either way a missing, truncated or
modified file, or one copied in from another save, raises ``CheckpointCorruptError`` naming the
file on every rank, never a model with wrong values. A checkpoint without a manifest loads only
with ``verify=False``. It reads back at any world size (DCP reshards), and reads DCP's metadata
with an unpickler that accepts only checkpoint metadata classes, never arbitrary objects.

A save changes nothing in the training: torch's state-dict helpers would step an optimizer that
has no state yet (zero gradients, lr 0) to create it, which makes Adam's step count 1 before the
first real step; ``save_checkpoint`` keeps them from it, so the checkpoint of an optimizer that
has not stepped holds its parameter groups only, and ``load_checkpoint`` gives the optimizer no
state from it (as a fresh one). A save inside a gradient-sync-off window (``set_requires_gradient_
sync(model, False)``) writes the shards and the optimizer state of the last step; the gradients
pending for the next step stay with the training and are not part of the checkpoint (as in
DeepSpeed and torch's DCP, which save no gradients).

``rank_state`` carries what else a resumed job needs per rank (step, LR scheduler, RNG states, data
position; tensors, numbers, strings and containers of them): it is written into the same staging
directory, so it is sealed and swapped in together with the shards, and ``load_checkpoint`` returns
it (read with ``torch.load(weights_only=True)``).

Both calls are collective. When a rank dies during one, the others' next exchange fails (gloo
raises at once when the dead process's connections close; otherwise the process group's timeout
bounds the wait), and they raise ``PeerLostError`` naming the ranks that did not answer a roll
call in the store within ``ROLL_CALL_S`` seconds.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .._torch.checkpoint import no_optimizer_state_init
from ..frontend.loading import loading as shard_access
from ..offload.deferred import deferred_reads, holds_deferred, materialized
from ..offload.incoming import IncomingWrites, incoming, incoming_loads
from ..runtime.guard import roll_call
from ..sharding.state import ShardState, module_state
from .stages import StageModules, is_flattened

_BACKUP = ".zero3-previous"
MANIFEST = "zero3_manifest.json"
_MANIFEST_FORMAT = "zero3-checkpoint-manifest"
_MANIFEST_VERSION = 1
_METADATA = ".metadata"
_SAVE_THREADS = 2  # writer threads of a save of offloaded values (two tensors held at a time)
_HASH_CHUNK = 2 << 20  # bytes read at a time to hash a file
# a load checks each file as it reads it when it can hold the values it loads into memory twice;
# else it checks every file first, and reads them again to load them
_STAGED_MAX = 256 << 20
# a file up to this size is read whole into memory (hashed on the way) and checked before DCP
# parses it; a larger one is hashed on a thread beside the parse and checked when DCP closes it
_READ_WHOLE_MAX = 64 << 20
_AHEAD_BYTES = 16 << 20  # of files read ahead of the one DCP parses (at least the next one)
ROLL_CALL_S = 2.0  # how long survivors of a failed collective wait for each other's answer


class CheckpointCorruptError(ValueError):
    """The files of a checkpoint do not match the manifest its save wrote (raised on every rank).

    ``file`` is the first damaged file, ``problems`` every (file, what is wrong) found.

    Example:
        ```python
        try:
            z3.load_checkpoint("ckpt/step_100", model, opt)
        except z3.CheckpointCorruptError as error:
            print(error.file, error.problems)  # nothing was loaded: use the checkpoint before
        ```
    """

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#checkpointcorrupterror)"

    def __init__(self, message: str, *, file: str | None = None, problems=()):
        super().__init__(message)
        self.file = file
        self.problems = list(problems)

    def __reduce__(self):  # whole across ranks (DCP gathers a read step's errors)
        return type(self), (self.args[0],), {"file": self.file, "problems": self.problems}


class PeerLostError(RuntimeError):
    """A rank died or stopped answering during a collective checkpoint call (raised on the
    others); ``lost`` lists the ranks that did not answer.

    Example:
        ```python
        try:
            z3.save_checkpoint("ckpt/step_100", model, opt)
        except z3.PeerLostError as error:
            print("lost ranks", error.lost)  # exit; torchrun --max-restarts restarts the job
        ```
    """

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#peerlosterror)"

    def __init__(self, message: str, *, lost=()):
        super().__init__(message)
        self.lost = list(lost)


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
    call = _next_call("save")
    # optimizer state per parameter (stages.py): loads into any cut of the model into stages
    state = _state(StageModules(model, flatten=True), optimizer, for_save=True)
    if extra:
        state["extra"] = dict(extra)
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = None
    try:
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        save_id = token[0]
        staging = f"{path}.tmp-{save_id}"
        if rank == 0:
            _remove_stale_staging(path, keep=staging)
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
        writer.fs = hashing = _HashingFileSystem()  # the manifest's digests, as bytes go out
        dcp.save(state, storage_writer=writer, planner=_ReadingPlanner())
        records = _exchange(
            lambda: _seal_own_files(staging, rank, rank_state, hashing.digests),
            "sealing the written files",
        )
        _exchange(
            lambda: _write_manifest(staging, save_id, world, records) if rank == 0 else None,
            "writing the manifest",
        )
        _exchange(lambda: _swap_in(staging, path) if rank == 0 else None, "swapping it in")
    except BaseException as error:
        # every rank has failed (DCP and the exchanges report a failure everywhere) or a peer is
        # gone; rank 0 owns the staging directory. The checkpoint at ``path`` is untouched.
        if rank == 0 and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        _raise_if_peer_lost(
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
    see the module docstring); a damaged one raises ``CheckpointCorruptError`` on every rank and
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
    path = _existing(os.fspath(path))
    call = _next_call("load")
    writes = IncomingWrites()  # offloaded values go from the checkpoint to their stores
    offloaded = getattr(optimizer, "_zero3_offload", None)
    created: list = []
    staged: list | None = None  # (in-memory destination, values read), copied in at the end
    try:  # the collective part: every rank fails alike here, or a peer is gone
        # every file there with its size; what is in them is checked as it is read
        manifest = _checked_manifest(path, hashing=False) if verify else None
        reader = _IncomingReader(path, writes, manifest)
        # the optimizer state's layout is the checkpoint's (stages.py), whatever model is given
        metadata = reader.read_metadata()
        flattened = is_flattened(metadata)
        # saved before the optimizer's first step: its parameter groups only, no state
        unstepped = optimizer is not None and flattened and _without_optimizer_state(metadata)
        stages = StageModules(model, flatten=flattened)
        if stages.prefixed and optimizer is not None and not flattened:
            raise ValueError(
                f"zero3: the checkpoint at {path!r} was saved from one module, with the "
                "optimizer state by parameter group; load it into one module (the whole model), "
                "not a list of pipeline stage modules"
            )
        if offloaded is not None and not unstepped:
            created = offloaded.prepare_load()
        state = _state(stages, optimizer, unstepped=unstepped)
        if extra:
            state["extra"] = dict(extra)
        if manifest is not None:
            if _verified_on_read(state):
                staged = []
            else:  # the in-memory values too large to hold twice: every file verified first
                reader.fs.verifying = False
                _checked_manifest(path, hashing=True)
        dcp.load(state, storage_reader=reader, planner=_IncomingPlanner(writes, staged))
    except BaseException as error:
        writes.discard()
        if created:
            offloaded.abandon_load(created)
        _raise_if_corrupt(error, path)
        _raise_if_peer_lost(error, call, f"load_checkpoint({path!r})", "Nothing was loaded.")
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
    with _shard_access(stages), _no_optimizer_init(unstepped):
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
    return _read_rank_state(path, rank, manifest, verify_file=staged is not None)


def load_rank_state(path: str | os.PathLike, rank: int, *, verify: bool = True) -> Any:
    """The ``rank_state`` that ``rank`` saved into the checkpoint at ``path`` (None if it saved
    none); not collective. With ``verify``, that file is checked against the manifest.

    Example:
        ```python
        state = z3.load_rank_state("ckpt/step_100", rank=0)  # one rank's, no collective
        ```
    """
    path = _existing(os.fspath(path))
    manifest = None
    if verify:
        manifest, problems = _read_manifest(path)
        if problems:
            raise _corrupt(path, problems)
    return _read_rank_state(path, rank, manifest, verify_file=verify)


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
    return _checked_manifest(_existing(os.fspath(path)), hashing=True)


def _checked_manifest(path: str, *, hashing: bool) -> dict[str, Any]:
    """The manifest, every file it names present with its size (and, with ``hashing``, its
    sha256); collective: the ranks share the files, every rank raises what any rank found."""
    manifest, problems = _read_manifest(path)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if manifest is not None:
        for name in sorted(manifest["files"])[rank::world]:
            want = manifest["files"][name]
            reason = _check_file(path, name, want, manifest["save_id"], hashing=hashing)
            if reason is not None:
                problems.append((name, reason))
    if distributed:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = sorted({tuple(p) for ranks in everyone for p in ranks})
    if problems:
        raise _corrupt(path, problems)
    return manifest


# ------------------------------------------------------------------ saving


class _ReadingPlanner(DefaultSavePlanner):
    """Offloaded values are read right before they are written (the writer asks for one
    tensor at a time), so a save never holds the offloaded state at once."""

    def resolve_data(self, write_item):
        return materialized(super().resolve_data(write_item))


def _state(
    stages: StageModules,
    optimizer: torch.optim.Optimizer | None,
    *,
    for_save: bool = False,
    unstepped: bool = False,
) -> dict[str, Any]:
    """The state dicts DCP saves from or loads into. ``unstepped`` (a load of a checkpoint saved
    before the optimizer's first step): the optimizer's parameter groups only."""
    # torch's state-dict helpers find parameters by walking attributes (``getattr(module,
    # "weight")``): with the shards visible that reads the sharded parameters, not a gather each.
    # For a save, offloaded values come as tensors read on use (``offload/deferred.py``); for a
    # load, as tensors written to their stores as DCP reads them (``offload/incoming.py``)
    deferred = deferred_reads() if for_save else incoming_loads()
    access = _shard_reads(stages) if for_save else _shard_access(stages)
    with access, deferred, _no_optimizer_init(for_save or unstepped):
        if optimizer is None:
            state = {"model": get_model_state_dict(stages.root, options=stages.options)}
        else:
            model_state, optim_state = get_state_dict(
                stages.root, optimizer, options=stages.options
            )
            if unstepped:  # flattened: "state.<fqn>.<key>", "param_groups.<fqn>.<key>"
                optim_state = {k: v for k, v in optim_state.items() if not k.startswith("state.")}
            state = {"model": model_state, "optim": optim_state}
    return stages.stored(state)


@contextlib.contextmanager
def _no_optimizer_init(active: bool = True):
    """torch's ``get_state_dict`` / ``set_state_dict`` create the state of an optimizer that has
    none by stepping it once with zero gradients and lr 0 (``_init_optim_state`` in
    ``torch/distributed/checkpoint/state_dict.py``, torch 2.4 to 2.13): Adam's step count is then
    1 before the first real step and every later update differs (and, inside a sync-off window,
    the step would be refused). Without it the optimizer's state dict holds what it has: its
    parameter groups only, before the first step."""
    with no_optimizer_state_init(active):
        yield


def _without_optimizer_state(metadata) -> bool:
    """Whether a checkpoint holds the optimizer's parameter groups but no state (saved before
    its first step)."""
    keys = metadata.state_dict_metadata
    return any(k.startswith("optim.param_groups.") for k in keys) and not any(
        k.startswith("optim.state.") for k in keys
    )


@contextlib.contextmanager
def _shard_reads(stages: StageModules):
    """For a save: reading ``module.<param>`` gives the sharded parameter (as ``loading()``
    does), also while gradient sync is off (the shards hold the values of the last step; the
    kept full parameters of ``keep_gathered`` equal them). Inside ``z3.gathered(model)`` the
    shards may not hold the writes made there yet: refused."""
    scoped = []
    for root in stages.modules:
        for module in root.modules():
            state = module_state(module)
            if state is None:
                continue
            for param_state in state.params.values():
                if param_state.state in (ShardState.GATHERED, ShardState.LOADING):
                    raise RuntimeError(
                        f"zero3: save_checkpoint reads the shards, and {param_state.fqn!r} is "
                        f"{param_state.state.name} (inside z3.gathered(model) or a load): save "
                        "after that block"
                    )
            if state.scope is not None:
                raise RuntimeError(
                    "zero3: save_checkpoint was called inside a leaf module's forward; save "
                    "between steps"
                )
            scoped.append((module, state))
    try:
        for module, state in scoped:
            state.scope = {attr: module._parameters[attr] for attr in state.params}
        yield
    finally:
        for _, state in scoped:
            state.scope = None


@contextlib.contextmanager
def _shard_access(stages: StageModules):
    with contextlib.ExitStack() as stack:
        for module in stages.modules:
            stack.enter_context(shard_access(module))
        yield


def _rank_state_name(rank: int) -> str:
    return f"zero3_rank_state.{rank}.pt"


def _seal_own_files(
    staging: str, rank: int, rank_state: Any, written: dict[str, tuple[int, str]]
) -> dict[str, dict[str, Any]]:
    """Write this rank's ``rank_state``; fsync every file this rank wrote and return its size and
    sha256: as hashed while it was written (``written``, by path), else read back."""
    names = sorted(
        n for n in os.listdir(staging) if n.startswith(f"__{rank}_") and n.endswith(".distcp")
    )
    if rank == 0:
        names.append(_METADATA)
    if rank_state is not None:
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        _write_durably(os.path.join(staging, _rank_state_name(rank)), buffer.getvalue())
        names.append(_rank_state_name(rank))
    records = {}
    for name in names:
        file = os.path.join(staging, name)
        _fsync_file(file)
        size, digest = written.get(file, (-1, ""))
        if size != os.path.getsize(file):  # not hashed as written (renamed, or appended to)
            size, digest = _digest(file)
        records[name] = {"size": size, "sha256": digest, "rank": rank}
    return records


def _write_manifest(staging: str, save_id: str, world: int, records: list[dict]) -> None:
    files: dict[str, dict[str, Any]] = {}
    for rank_records in records:
        files.update(rank_records)
    metadata = SafeFileSystemReader(staging).read_metadata()
    referenced = {info.relative_path for info in metadata.storage_data.values()}
    unsealed = sorted(referenced - files.keys())
    if unsealed:
        raise RuntimeError(f"zero3: DCP wrote files that no rank sealed: {unsealed}")
    manifest = {
        "format": _MANIFEST_FORMAT,
        "version": _MANIFEST_VERSION,
        "save_id": save_id,
        "world_size": world,
        "created": time.time(),
        "torch": torch.__version__,
        "files": files,
    }
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    _write_durably(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1).encode())
    _fsync_dir(staging)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_durably(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _HashingFileSystem(FileSystem):
    """The checkpoint writer's file system: each file opened for writing is hashed as its bytes
    go out (in the writer's threads), so sealing does not read the checkpoint back."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if mode != "wb":
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        if hashing.sha is not None:
            with self._lock:
                self.digests[os.fspath(path)] = (hashing.size, hashing.sha.hexdigest())


class _HashingStream(io.RawIOBase):
    """A file being written from its start, hashed on the way; any seek gives the hash up."""

    def __init__(self, raw) -> None:
        self.raw, self.size, self.sha = raw, 0, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written = self.raw.write(data)
        if self.sha is not None:
            view = memoryview(data).cast("B")[:written]
            self.sha.update(view)
            self.size += len(view)
        return written

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.sha = None
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(path: str) -> tuple[int, str]:
    size, digest, _ = _hashed_read(path, keep=False)
    return size, digest


def _hashed_read(path: str, keep: bool) -> tuple[int, str, memoryview | None]:
    """(size, sha256, with ``keep`` the bytes) of the file at ``path``; each chunk is read while
    the one before it is hashed (both give up the GIL: the disk and the hashing overlap)."""
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as reader:
        whole = memoryview(bytearray(os.fstat(f.fileno()).st_size)) if keep else None
        spare = [memoryview(bytearray(_HASH_CHUNK)) for _ in range(0 if keep else 2)]

        def read(index: int) -> memoryview:
            if whole is None:
                view = spare[index % 2]
            else:
                view = whole[index * _HASH_CHUNK : (index + 1) * _HASH_CHUNK]
            done = 0
            while done < len(view) and (n := f.readinto(view[done:])):
                done += n
            return view[:done]

        size, index, chunk = 0, 0, read(0)
        while len(chunk):
            following = reader.submit(read, index + 1)
            sha.update(chunk)
            size += len(chunk)
            index += 1
            chunk = following.result()
    return size, sha.hexdigest(), None if whole is None else whole[:size]


def _exchange(fn: Callable[[], Any], what: str) -> list[Any]:
    """Run ``fn`` on every rank and all-gather the results; if it failed on any rank, raise on
    every rank (so no rank goes on alone)."""
    try:
        result = (True, fn())
    except Exception as error:  # noqa: BLE001  - reported on every rank below
        result = (False, f"rank {dist.get_rank()}: {type(error).__name__}: {error}")
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    failures = [value for ok, value in everyone if not ok]
    if failures:
        raise RuntimeError(f"zero3: checkpoint save failed while {what}: " + "; ".join(failures))
    return [value for _, value in everyone]


def _remove_stale_staging(path: str, keep: str) -> None:
    """Staging directories of earlier saves to ``path`` that were interrupted (no save to
    ``path`` can be running now: every rank is in this one)."""
    parent, base = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        full = os.path.join(parent, name)
        if name.startswith(base + ".tmp-") and full != os.path.abspath(keep):
            shutil.rmtree(full, ignore_errors=True)


def _swap_in(staging: str, path: str) -> None:
    backup = path + _BACKUP
    if os.path.exists(backup):  # left over by a crash between the two renames below
        if os.path.exists(path):
            shutil.rmtree(backup)
        else:
            os.rename(backup, path)
    had_previous = os.path.exists(path)
    if had_previous:
        os.rename(path, backup)
    os.rename(staging, path)  # from here on the new checkpoint is the one loaded
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if had_previous:
        shutil.rmtree(backup)


def _existing(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + _BACKUP):  # a save crashed after moving the previous one aside
        return path + _BACKUP
    raise FileNotFoundError(f"zero3: no checkpoint at {path!r}")


# ------------------------------------------------------------------ verifying


def _read_manifest(path: str) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    where = os.path.join(path, MANIFEST)
    if not os.path.exists(where):
        return None, [
            (
                MANIFEST,
                "is missing: the checkpoint was not sealed by save_checkpoint (written by an "
                "older zero3_compile, by plain torch.distributed.checkpoint, or its directory "
                "was assembled by hand); load_checkpoint(..., verify=False) loads it unchecked",
            )
        ]
    try:
        with open(where, "rb") as f:
            manifest = json.loads(f.read().decode())
    except (OSError, ValueError) as error:
        return None, [(MANIFEST, f"is unreadable ({type(error).__name__}: {error})")]
    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        return None, [(MANIFEST, "is not a zero3_compile checkpoint manifest")]
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        return None, [(MANIFEST, "does not match its own checksum: it was modified after the save")]
    files = manifest.get("files")
    if not isinstance(files, dict) or _METADATA not in files:
        return None, [(MANIFEST, f"does not list DCP's {_METADATA} file")]
    return manifest, []


def _check_file(
    path: str, name: str, want: dict[str, Any], save_id: str, *, hashing: bool = True
) -> str | None:
    where = os.path.join(path, name)
    if not os.path.isfile(where):
        return f"is missing (save {save_id} wrote {want['size']} bytes there)"
    try:
        size, digest = os.path.getsize(where), None
        if size == want["size"] and hashing:
            _, digest = _digest(where)
    except OSError as error:
        return f"is unreadable ({type(error).__name__}: {error})"
    return _content_problem(path, name, want, save_id, size, digest)


def _content_problem(
    path: str, name: str, want: dict[str, Any], save_id: str, size: int, digest: str | None
) -> str | None:
    """What is wrong with a file of ``size`` bytes and sha256 ``digest`` (None: not hashed)."""
    if size != want["size"]:
        how = "truncated" if size < want["size"] else "longer than written"
        return f"has {size} bytes where save {save_id} wrote {want['size']} ({how})"
    if digest is not None and digest != want["sha256"]:
        return (
            f"does not match the sha256 save {save_id} recorded for it (flipped bits, an "
            f"overwrite, or a file of another save){_origin(path, name, digest)}"
        )
    return None


def _origin(path: str, name: str, digest: str) -> str:
    """Where a file with this content comes from, if a sibling checkpoint's manifest knows it."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        siblings = sorted(os.listdir(parent))
    except OSError:
        return ""
    for sibling in siblings:
        where = os.path.join(parent, sibling)
        if where == os.path.abspath(path) or not os.path.isfile(os.path.join(where, MANIFEST)):
            continue
        manifest, problems = _read_manifest(where)
        if problems:
            continue
        for other, record in manifest["files"].items():
            if record.get("sha256") == digest:
                return (
                    f": it is {other!r} of the checkpoint {where!r} (save {manifest['save_id']}), "
                    "shards of two saves mixed"
                )
    return ""


def _corrupt(path: str, problems: list[tuple[str, str]]) -> CheckpointCorruptError:
    first, reason = problems[0]
    lines = [f"zero3: checkpoint {path!r} is damaged: file {first!r} {reason}."]
    lines += [f"  also: {name!r} {why}." for name, why in problems[1:]]
    lines.append(
        "Nothing was loaded. Restore the file or load an older checkpoint (a resumed job falls "
        "back to the previous one)."
    )
    return CheckpointCorruptError("\n".join(lines), file=first, problems=problems)


def _read_rank_state(
    path: str, rank: int, manifest: dict[str, Any] | None, verify_file: bool
) -> Any:
    name = _rank_state_name(rank)
    where = os.path.join(path, name)
    if manifest is not None:
        record = manifest["files"].get(name)
        if record is None:
            return None
        if verify_file:
            reason = _check_file(path, name, record, manifest["save_id"])
            if reason is not None:
                raise _corrupt(path, [(name, reason)])
    elif not os.path.exists(where):
        return None
    with open(where, "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=True)


def _verified_on_read(state: dict[str, Any]) -> bool:
    """Whether a load checks each file as it reads it (``_VerifyingFileSystem``): it then holds
    the values it loads into memory twice (``staged``) until every rank read everything and
    every file it read was intact. The same answer on every rank (the load verifies first on
    all, or on none)."""
    from torch.distributed.tensor import DTensor

    from .._torch.pytree import tree_leaves

    in_memory = 0
    for value in tree_leaves(state):
        if isinstance(value, torch.Tensor) and incoming(value) is None:
            local = value._local_tensor if isinstance(value, DTensor) else value
            in_memory += local.numel() * local.element_size()
    fits = in_memory <= _STAGED_MAX
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, fits)
        fits = all(everyone)
    return fits


def _raise_if_corrupt(error: BaseException, path: str) -> None:
    """A file some rank found damaged as it read it: the same ``CheckpointCorruptError`` on every
    rank (DCP raised its read step's failures on all of them)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, CheckpointException):
        return
    problems = set()
    for failure in (getattr(error, "failures", {}) or {}).values():
        found = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(found, CheckpointCorruptError):
            problems.update(tuple(p) for p in found.problems)
    if problems:
        raise _corrupt(path, sorted(problems)) from error


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


# ------------------------------------------------------------------ lost ranks

_calls = 0


def _next_call(kind: str) -> str:
    """A name every rank gives the same collective checkpoint call (they call them in order)."""
    global _calls
    _calls += 1
    return f"{kind}{_calls}"


def _lost_ranks(call: str, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that do not answer a roll call in the store within ``wait_s`` after a failed
    collective (every survivor fails at the same exchange); None if every rank answered."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    alive = roll_call(f"zero3/checkpoint/{call}/rollcall/", range(world), wait_s)
    if alive is None:  # the store is gone: its host (rank 0 unless torchrun's agent hosts it) died
        return [0] if rank != 0 else None
    return sorted(set(range(world)) - alive - {rank}) or None


def _raise_if_peer_lost(error: BaseException, call: str, what: str, note: str) -> None:
    if isinstance(error, (KeyboardInterrupt, SystemExit, CheckpointCorruptError)):
        return
    lost = _lost_ranks(call)
    if not lost:
        return
    cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
    raise PeerLostError(
        f"zero3: {what} on rank {dist.get_rank()}: lost rank(s) {lost}: they did not answer "
        f"within {ROLL_CALL_S:.0f}s after the collective failed ({type(error).__name__}: "
        f"{cause}). {note}",
        lost=lost,
    ) from error


# ------------------------------------------------------------------ safe metadata loading


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its dataclasses, torch sizes and dtypes, paths."""

    _EXACT = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._EXACT:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint."):
                return obj
        raise pickle.UnpicklingError(
            f"zero3: refusing to load {module}.{name} from checkpoint metadata (only checkpoint "
            "metadata classes are allowed; the file may have been tampered with)"
        )


class _IncomingPlanner(DefaultLoadPlanner):
    """Items of offloaded values (``IncomingTensor``) are read into buffers of their own and
    written to their stores as they arrive (``offload/incoming.py``); the rest as DCP does, or,
    with ``staged`` (a list), into buffers copied in only once the whole load succeeded."""

    def __init__(self, writes: IncomingWrites, staged: list | None = None):
        super().__init__()
        self.writes = writes
        self.staged = staged

    def resolve_tensor(self, read_item):
        value = incoming(self.state_dict[read_item.dest_index.fqn])
        if value is None:
            target = super().resolve_tensor(read_item)
            if self.staged is None:
                return target
            buffer = torch.empty_like(target, memory_format=torch.contiguous_format)
            self.staged.append((target, buffer))
            return buffer
        return self.writes.target(value, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        value = incoming(self.state_dict[read_item.dest_index.fqn])
        if value is None:
            return super().commit_tensor(read_item, tensor)
        self.writes.arrived(value, read_item.dest_offsets, read_item.lengths, tensor)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata load cannot run arbitrary code."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _IncomingReader(SafeFileSystemReader):
    """Reads as DCP does (each file checked against ``manifest`` as it is opened, while
    ``verifying``), then waits for the stores' writes of what it read: a damaged file or a
    failed write fails DCP's read step, which every rank then raises."""

    def __init__(self, path: str, writes: IncomingWrites, manifest: dict[str, Any] | None):
        super().__init__(path)
        self.writes = writes
        if manifest is not None:
            self.fs = _VerifyingFileSystem(path, manifest)

    def read_data(self, plan, planner):
        verifying = isinstance(self.fs, _VerifyingFileSystem) and self.fs.verifying
        if verifying:
            order: dict[str, None] = {}  # the files in the order DCP opens them
            for item in plan.items:
                relative = self.storage_data[item.storage_index].relative_path
                order.setdefault(os.fspath(self.fs.concat_path(self.path, relative)))
            self.fs.read_ahead(list(order))
        try:
            done = super().read_data(plan, planner)
        finally:
            if verifying:
                self.fs.stop()
        self.writes.drain()
        return done


class _VerifyingFileSystem(FileSystem):
    """A file of the checkpoint opened for reading is checked against the manifest as it is
    read, so the checkpoint is read from the disk once (``load_checkpoint``). A file of up to
    ``_READ_WHOLE_MAX`` bytes is read whole into memory, hashed on the way, and checked before
    DCP parses it; a larger one is hashed on a thread while DCP parses the items it reads from
    it (the two share the page cache) and checked when DCP closes it, so no large file is held
    in the process (``load_checkpoint`` commits nothing until every rank read everything it
    needs from intact files)."""

    def __init__(self, root: str, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.root = os.path.abspath(root)
        self.manifest = manifest
        self.verifying = True
        self.queue: collections.deque[str] = collections.deque()
        self.ahead: dict[str, tuple[Future, int]] = {}  # path -> its _hashed_read, its size
        self.pool: ThreadPoolExecutor | None = None

    def read_ahead(self, paths: list[str]) -> None:
        """The files about to be opened, in order: each is read (and hashed) on a thread ahead
        of its turn, up to ``_AHEAD_BYTES`` of them (at least the next one), so the disk keeps
        reading while the files before it are parsed and copied."""
        self.queue.extend(paths)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="zero3-ckpt-read")
        self._top_up()

    def _start(self, path: str) -> tuple[Future, int]:
        size = self._size(path)
        keep = size <= _READ_WHOLE_MAX
        if self.pool is None:  # a file opened outside a read step (the metadata): read first
            done: Future = Future()
            try:
                done.set_result(_hashed_read(path, keep))
            except OSError as error:
                done.set_exception(error)
            return done, size
        return self.pool.submit(_hashed_read, path, keep), size

    def _top_up(self) -> None:
        ahead = sum(size for _, size in self.ahead.values())
        while self.queue and (not self.ahead or ahead + self._size(self.queue[0]) <= _AHEAD_BYTES):
            path = self.queue.popleft()
            self.ahead[path] = self._start(path)
            ahead += self._size(path)

    def _size(self, path: str) -> int:
        name = os.path.relpath(os.path.abspath(path), self.root)
        return self.manifest["files"].get(name, {}).get("size", 0)

    def stop(self) -> None:
        self.queue.clear()
        for future, _ in self.ahead.values():
            future.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.ahead, self.pool = {}, None

    def _check(self, name: str, want: dict[str, Any], read: Future, cause=None) -> None:
        """Raise ``CheckpointCorruptError`` if the file ``read`` hashed is not as saved."""
        try:
            size, digest, _ = read.result()
        except OSError as error:
            reason = f"is unreadable ({type(error).__name__}: {error})"
        else:
            reason = _content_problem(self.root, name, want, self.manifest["save_id"], size, digest)
        if reason is not None:
            raise _corrupt(self.root, [(name, reason)]) from cause

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        name = os.path.relpath(os.path.abspath(os.fspath(path)), self.root)
        if not self.verifying or "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        want = self.manifest["files"].get(name)
        if want is None:
            raise _corrupt(self.root, [(name, "is not in the manifest: no save wrote it")])
        if os.fspath(path) in self.queue:
            self.queue.remove(os.fspath(path))
        read, _ = self.ahead.pop(os.fspath(path), None) or self._start(os.fspath(path))
        if self.pool is not None:
            self._top_up()
        if want["size"] <= _READ_WHOLE_MAX:  # read whole: checked before anything parses it
            self._check(name, want, read)
            yield _MemoryFile(read.result()[2])
            return
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as error:  # what a damaged file does to the parse: named as the damage
            self._check(name, want, read, cause=error)
            raise
        self._check(name, want, read)


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes in memory (no copy of them, as ``BytesIO`` makes)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self.data = data
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), len(self.data) - self.position))
        view[:n] = self.data[self.position : self.position + n]
        self.position += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.data)}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position
