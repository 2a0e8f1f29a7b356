"""The manifest of a checkpoint and checking files against it.

A save writes ``zero3_manifest.json``: every file's size and sha256, the save id, and a checksum
of the manifest itself (written by ``durable.write_manifest``). Here: reading it back, checking a
file against its record (``check_file``, ``content_problem``), the collective check of a whole
checkpoint (``checked_manifest``: the ranks share the files), and the error that names the
damaged files (``CheckpointCorruptError``, made by ``corrupt``), telling where a file copied in
from another save comes from.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch.distributed as dist

from ...cluster import agree
from . import hashing

MANIFEST = "zero3_manifest.json"
MANIFEST_FORMAT = "zero3-checkpoint-manifest"
MANIFEST_VERSION = 1
METADATA = ".metadata"


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


def rank_state_name(rank: int) -> str:
    return f"zero3_rank_state.{rank}.pt"


def manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: str) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
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
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, [(MANIFEST, "is not a zero3_compile checkpoint manifest")]
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        return None, [(MANIFEST, "does not match its own checksum: it was modified after the save")]
    files = manifest.get("files")
    if not isinstance(files, dict) or METADATA not in files:
        return None, [(MANIFEST, f"does not list DCP's {METADATA} file")]
    return manifest, []


def check_file(
    path: str, name: str, want: dict[str, Any], save_id: str, *, contents: bool = True
) -> str | None:
    """What is wrong with the file ``name`` of the checkpoint at ``path`` (None: intact): its
    presence and size, and with ``contents`` its sha256."""
    where = os.path.join(path, name)
    if not os.path.isfile(where):
        return f"is missing (save {save_id} wrote {want['size']} bytes there)"
    try:
        size, digest = os.path.getsize(where), None
        if size == want["size"] and contents:
            _, digest = hashing.file_digest(where)
    except OSError as error:
        return f"is unreadable ({type(error).__name__}: {error})"
    return content_problem(path, name, want, save_id, size, digest)


def content_problem(
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
        manifest, problems = read_manifest(where)
        if problems:
            continue
        for other, record in manifest["files"].items():
            if record.get("sha256") == digest:
                return (
                    f": it is {other!r} of the checkpoint {where!r} (save {manifest['save_id']}), "
                    "shards of two saves mixed"
                )
    return ""


def corrupt(path: str, problems: list[tuple[str, str]]) -> CheckpointCorruptError:
    first, reason = problems[0]
    lines = [f"zero3: checkpoint {path!r} is damaged: file {first!r} {reason}."]
    lines += [f"  also: {name!r} {why}." for name, why in problems[1:]]
    lines.append(
        "Nothing was loaded. Restore the file or load an older checkpoint (a resumed job falls "
        "back to the previous one)."
    )
    return CheckpointCorruptError("\n".join(lines), file=first, problems=problems)


def checked_manifest(path: str, *, contents: bool) -> dict[str, Any]:
    """The manifest, every file it names present with its size (and, with ``contents``, its
    sha256); collective: the ranks share the files, every rank raises what any rank found."""
    manifest, problems = read_manifest(path)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if manifest is not None:
        for name in sorted(manifest["files"])[rank::world]:
            want = manifest["files"][name]
            reason = check_file(path, name, want, manifest["save_id"], contents=contents)
            if reason is not None:
                problems.append((name, reason))
    problems = sorted({tuple(p) for found in agree(problems) for p in found})
    if problems:
        raise corrupt(path, problems)
    return manifest
