"""A ``z3.save_checkpoint`` directory as one consolidated weights file, offline: DeepSpeed's
``zero_to_fp32.py``.

```
python -m zero3_compile.deepspeed.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--bin]
    [--max-shard-size 5GB] [--dtype float32|bfloat16|float16|keep] [--no-verify]
```
writes ``OUTPUT_DIR/model.safetensors`` (``--bin``: ``pytorch_model.bin``), or, for weights
larger than ``--max-shard-size``, numbered files with a Hugging Face index
(``model.safetensors.index.json``): ``from_pretrained`` reads either. Needs no process group and
no GPU, whatever the number of ranks that saved the checkpoint. Memory stays bounded: each
tensor is read from the checkpoint's DCP files on its own (its chunks from every rank's file,
``_BATCH_BYTES`` of tensors at a time) and written out before the next one; a safetensors file
is written as it streams (its header first: the sizes are in the checkpoint's metadata), a
``.bin`` file holds one output file's tensors at a time. The checkpoint's files are checked
against its manifest first (``--no-verify`` skips that).

Only the model's weights are written (the optimizer state and ``extra`` stay in the
checkpoint), under the model's own parameter and buffer names, cast to ``--dtype`` (floating
point tensors only; ``keep``: as saved).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import struct
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..io.checkpoint import SafeFileSystemReader, verify_checkpoint

log = logging.getLogger(__name__)

_BATCH_BYTES = 256 << 20  # tensors read from the checkpoint in one pass of DCP's reader
_MODEL = "model."
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Reader(SafeFileSystemReader):
    """The checkpoint's reader, its metadata read (and checked) once for every pass."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def _plan(
    reader: _Reader, dtype: torch.dtype | None
) -> list[tuple[str, str, torch.Size, torch.dtype]]:
    """(output name, checkpoint key, shape, output dtype) of every model tensor, in save order."""
    entries = []
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if not key.startswith(_MODEL):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            log.warning("zero3: zero_to_fp32 skips %r: not a tensor", key)
            continue
        stored = meta.properties.dtype
        out = dtype if dtype is not None and stored.is_floating_point else stored
        entries.append((key[len(_MODEL) :], key, meta.size, out))
    if not entries:
        raise ValueError(
            f"zero3: {reader.path} holds no model tensors (keys 'model.*'); is it a "
            "zero3_compile.save_checkpoint directory?"
        )
    return entries


def _open(checkpoint_dir: str | os.PathLike, verify: bool) -> _Reader:
    path = os.fspath(checkpoint_dir)
    if verify:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "zero3: zero_to_fp32 runs offline; in a distributed job its check of the "
                "checkpoint would be collective: run it without a process group, or pass "
                "verify=False (z3.verify_checkpoint(path) checks it on every rank)"
            )
        verify_checkpoint(path)
    return _Reader(path)


def _read(reader: _Reader, entries) -> Iterator[tuple[str, torch.Tensor]]:
    """Each entry's whole tensor, in order, read ``_BATCH_BYTES`` of tensors at a time."""
    meta = reader.read_metadata().state_dict_metadata
    for batch in _batches(entries, meta):
        targets = {
            key: torch.empty(shape, dtype=meta[key].properties.dtype) for _, key, shape, _ in batch
        }
        with warnings.catch_warnings():  # DCP's note that it loads in one process: it does
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, no_dist=True)
        for name, key, _, dtype in batch:
            yield name, targets.pop(key).to(dtype)


def _batches(entries, meta) -> Iterator[list]:
    batch, size = [], 0
    for entry in entries:
        nbytes = entry[2].numel() * meta[entry[1]].properties.dtype.itemsize
        if batch and size + nbytes > _BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += nbytes
    if batch:
        yield batch


def iter_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32, verify=True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every model weight of a ``z3.save_checkpoint`` directory, one at a
    time (``dtype=None``: as saved).

    Example:
        ```python
        for name, tensor in iter_zero_checkpoint("ckpt/step_1000"):
            print(name, tensor.shape)
        ```
    """
    reader = _open(checkpoint_dir, verify)
    yield from _read(reader, _plan(reader, dtype))


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The model's whole fp32 state dict from a ``z3.save_checkpoint`` directory, in memory
    (DeepSpeed's function of the same name).

    Example:
        ```python
        state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpt/step_1000")
        ```
    """
    return dict(iter_zero_checkpoint(checkpoint_dir, verify=verify))


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike, *, verify: bool = True
) -> torch.nn.Module:
    """Load a ``z3.save_checkpoint`` directory's weights (fp32) into a plain ``model``; return it.

    Example:
        ```python
        model = load_state_dict_from_zero_checkpoint(MyModel(), "ckpt/step_1000")
        ```
    """
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, verify=verify))
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    safe_serialization: bool = True,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = torch.float32,
    verify: bool = True,
) -> list[str]:
    """Write the weights of a ``z3.save_checkpoint`` directory into ``output_dir`` as Hugging
    Face names them (``model.safetensors``, or ``pytorch_model.bin`` with
    ``safe_serialization=False``; numbered files and an index past ``max_shard_size``); return
    the paths written.

    Example:
        ```python
        convert_zero_checkpoint_to_fp32_state_dict("ckpt/step_1000", "export/")
        ```
    """
    reader = _open(checkpoint_dir, verify)
    entries = _plan(reader, dtype)
    limit = _parse_size(max_shard_size)
    files = _split(entries, limit)
    os.makedirs(output_dir, exist_ok=True)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = (
        [f"{stem}.{ext}"]
        if len(files) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(files):05d}.{ext}" for i in range(len(files))]
    )
    tensors = _read(reader, entries)
    written = []
    for name, members in zip(names, files):
        path = os.path.join(output_dir, name)
        if safe_serialization:
            _write_safetensors(path, members, tensors)
        else:
            torch.save(dict(next(tensors) for _ in members), path)
        written.append(path)
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(_out_bytes(e) for e in entries)},
            "weight_map": {e[0]: n for n, members in zip(names, files) for e in members},
        }
        path = os.path.join(output_dir, f"{stem}.{ext}.index.json")
        with open(path, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        written.append(path)
    return written


def _out_bytes(entry) -> int:
    return entry[2].numel() * entry[3].itemsize


def _split(entries, limit: int) -> list[list]:
    files: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = _out_bytes(entry)
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def _write_safetensors(path: str, members, tensors: Iterator) -> None:
    """A safetensors file written as the tensors arrive: the header from the plan, then each
    tensor's bytes in order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, shape, dtype in members:
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"zero3: safetensors cannot hold {name!r} of dtype {dtype}; use --bin")
        end = offset + shape.numel() * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, _, _, _ in members:
            got, tensor = next(tensors)
            assert got == name, (got, name)
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"zero3: max_shard_size {size!r} is not a size (e.g. 5GB, 500MB)")
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
    return int(float(match.group(1)) * units[(match.group(2) or "").upper()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m zero3_compile.deepspeed.zero_to_fp32",
        description="Consolidate a zero3_compile.save_checkpoint directory into one weights file.",
    )
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--bin", action="store_true", help="pytorch_model.bin, not safetensors")
    parser.add_argument("--max-shard-size", default="5GB", help="split larger outputs (5GB)")
    parser.add_argument("--dtype", default="float32", choices=[*_DTYPES, "keep"])
    parser.add_argument("--no-verify", action="store_true", help="skip the manifest check")
    args = parser.parse_args(argv)
    for path in convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        safe_serialization=not args.bin,
        max_shard_size=args.max_shard_size,
        dtype=None if args.dtype == "keep" else _DTYPES[args.dtype],
        verify=not args.no_verify,
    ):
        print(path)  # the command's output: the files it wrote


if __name__ == "__main__":
    main()
