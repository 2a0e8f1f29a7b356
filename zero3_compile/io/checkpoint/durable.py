"""Durable writes of a save: every file fsynced and recorded before the manifest names it, the
manifest written last, and the sealed directory swapped in for the previous checkpoint
(``seal``), so an interrupted save leaves the previous checkpoint intact and loadable.

A save writes into ``path.tmp-<save id>``; each rank fsyncs and records the files it wrote,
rank 0 merges the records into the manifest, then renames the directory to ``path`` (the previous
checkpoint moved aside to ``path.zero3-previous`` first and deleted last: ``existing`` finds it
after a crash between the two renames). Each of the three steps is agreed on by every rank
(``cluster.attempt``): a failure on one rank raises on all.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from ...cluster import Failure, attempt
from . import hashing
from .manifest import (
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    METADATA,
    manifest_digest,
    rank_state_name,
)
from .metadata import SafeFileSystemReader

BACKUP = ".zero3-previous"


def seal(
    staging: str,
    path: str,
    save_id: str,
    rank_state: Any,
    written: dict[str, tuple[int, str]],
) -> None:
    """Seal the files DCP wrote into ``staging`` (each rank its own, ``written`` holding the
    digests taken as they were written), write the manifest (rank 0), then swap ``staging`` in
    for ``path`` (rank 0); every rank raises if a step failed on any rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    records = attempt(
        lambda: seal_own_files(staging, rank, rank_state, written),
        error=_save_failed("sealing the written files"),
    )
    attempt(
        lambda: write_manifest(staging, save_id, world, records) if rank == 0 else None,
        error=_save_failed("writing the manifest"),
    )
    attempt(
        lambda: swap_in(staging, path) if rank == 0 else None,
        error=_save_failed("swapping it in"),
    )


def _save_failed(what: str):
    def error(failures: list[Failure]) -> RuntimeError:
        listed = "; ".join(str(f) for f in failures)
        return RuntimeError(f"zero3: checkpoint save failed while {what}: {listed}")

    return error


def seal_own_files(
    staging: str, rank: int, rank_state: Any, written: dict[str, tuple[int, str]]
) -> dict[str, dict[str, Any]]:
    """Write this rank's ``rank_state``; fsync every file this rank wrote and return its size and
    sha256: as hashed while it was written (``written``, by path), else read back."""
    names = sorted(
        n for n in os.listdir(staging) if n.startswith(f"__{rank}_") and n.endswith(".distcp")
    )
    if rank == 0:
        names.append(METADATA)
    if rank_state is not None:
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        write_durably(os.path.join(staging, rank_state_name(rank)), buffer.getvalue())
        names.append(rank_state_name(rank))
    records = {}
    for name in names:
        file = os.path.join(staging, name)
        fsync_file(file)
        size, digest = written.get(file, (-1, ""))
        if size != os.path.getsize(file):  # not hashed as written (renamed, or appended to)
            size, digest = hashing.file_digest(file)
        records[name] = {"size": size, "sha256": digest, "rank": rank}
    return records


def write_manifest(staging: str, save_id: str, world: int, records: list[dict]) -> None:
    files: dict[str, dict[str, Any]] = {}
    for rank_records in records:
        files.update(rank_records)
    metadata = SafeFileSystemReader(staging).read_metadata()
    referenced = {info.relative_path for info in metadata.storage_data.values()}
    unsealed = sorted(referenced - files.keys())
    if unsealed:
        raise RuntimeError(f"zero3: DCP wrote files that no rank sealed: {unsealed}")
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "save_id": save_id,
        "world_size": world,
        "created": time.time(),
        "torch": torch.__version__,
        "files": files,
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    write_durably(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1).encode())
    fsync_dir(staging)


def write_durably(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
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


def remove_stale_staging(path: str, keep: str) -> None:
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


def swap_in(staging: str, path: str) -> None:
    backup = path + BACKUP
    if os.path.exists(backup):  # left over by a crash between the two renames below
        if os.path.exists(path):
            shutil.rmtree(backup)
        else:
            os.rename(backup, path)
    had_previous = os.path.exists(path)
    if had_previous:
        os.rename(path, backup)
    os.rename(staging, path)  # from here on the new checkpoint is the one loaded
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if had_previous:
        shutil.rmtree(backup)


def existing(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + BACKUP):  # a save crashed after moving the previous one aside
        return path + BACKUP
    raise FileNotFoundError(f"zero3: no checkpoint at {path!r}")
