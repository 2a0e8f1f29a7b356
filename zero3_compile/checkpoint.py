"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic saves, safe loads.

``save_checkpoint(path, model, optimizer)`` writes every rank's shards of the model and optimizer
state (keys are parameter names, as ``get_state_dict`` gives them) into a fresh directory and only
then swaps it in for ``path``: an interrupted save leaves the previous checkpoint intact.
``load_checkpoint`` reads it back at any world size (DCP reshards), and reads DCP's metadata with
an unpickler that accepts only checkpoint metadata classes, never arbitrary objects.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

_BACKUP = ".zero3-previous"


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``) shards to the directory ``path``; every rank must call it.

    The checkpoint is written to ``path.tmp-<id>`` first; once every rank has finished, rank 0
    renames it to ``path`` (moving the previous checkpoint aside first and deleting it last).
    """
    path = os.fspath(path)
    state = _state(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    staging = f"{path}.tmp-{token[0]}"
    try:
        dcp.save(state, storage_writer=FileSystemWriter(staging))
    except BaseException:
        # DCP reports a failure on every rank; the previous checkpoint at ``path`` is untouched
        shutil.rmtree(staging, ignore_errors=True)
        raise
    dist.barrier()
    if dist.get_rank() == 0:
        _swap_in(staging, path)
    dist.barrier()


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Load a checkpoint written by ``save_checkpoint`` (at any world size) into ``model``/``optimizer``.

    ``extra`` receives, in place, the tensors saved under the same keys.
    """
    path = _existing(os.fspath(path))
    state = _state(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    dcp.load(state, storage_reader=SafeFileSystemReader(path))
    if optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        set_model_state_dict(model, state["model"])
    if extra:
        for key, value in state["extra"].items():
            if extra[key] is not value:
                extra[key].copy_(value)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


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
    if had_previous:
        shutil.rmtree(backup)


def _existing(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + _BACKUP):  # a save crashed after moving the previous one aside
        return path + _BACKUP
    raise FileNotFoundError(f"zero3: no checkpoint at {path!r}")


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
