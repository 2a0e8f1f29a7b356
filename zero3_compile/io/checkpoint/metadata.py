"""Reading DCP's ``.metadata`` without running arbitrary code: an unpickler that accepts only
checkpoint metadata classes (``SafeFileSystemReader``)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from ..._torch.checkpoint import metadata_path


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
        with self.fs.create_stream(metadata_path(self, kwargs.get("rank")), "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
