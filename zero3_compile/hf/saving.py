"""``save_pretrained``: a normal Hugging Face folder from a sharded model, a file at a time.

Writes what ``model.save_pretrained`` of the unsharded model writes (``config.json``,
``generation_config.json``, ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``), so that plain ``from_pretrained`` loads identical tensors:
tied parameters once (under the name the model's ``_tied_weights_keys`` keep), the checkpoint
layout restored where transformers converted it on load (``revert_weight_conversion``: MoE
experts stacked on load are written as the checkpoint had them).

A ``PeftModel`` is written as peft writes it (``adapter_config.json``,
``adapter_model.safetensors``: ``peft.py``), or with ``merge_adapters=True`` as the plain model
with its LoRA adapters merged, under the base model's names, each merged weight computed when its
file is written.

Every rank calls it. Files are planned from the parameters' shapes (greedy in name order, at most
``max_shard_size`` each, as ``split_torch_state_dict_into_shards``); for each file the ranks
gather its tensors (one collective each, the same order everywhere), rank 0 writes the file and
the others drop the full tensors at once: no rank holds more than one output file beyond its
shards. A failure on rank 0 (a full disk) is raised on every rank before the next file, never a
hang; files are written under a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.dynamo import uncompiled
from .._torch.modules import non_persistent_buffer_names, own_buffers, own_parameters
from ..collectives.ops import UNSHARD
from ..runtime.guard import DEFAULT_TIMEOUT_S
from ..sharding.state import ShardedParam, state_of
from .agreement import Agreement

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}  # fmt: skip
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    state_dict: dict[str, torch.Tensor] | None = None,
    save_original_format: bool = True,
    merge_adapters: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[str]:
    """Write ``model`` (sharded) as a Hugging Face folder; returns the files rank 0 wrote.

    A peft model: its adapters (``adapter_config.json``, ``adapter_model.safetensors``), or with
    ``merge_adapters=True`` the merged model as a plain folder (what ``merge_and_unload()``
    followed by ``save_pretrained`` writes).

    ```python
    z3hf.save_pretrained(model, "out")                            # every rank calls it
    z3hf.save_pretrained(peft_model, "merged", merge_adapters=True)
    ```
    """
    from transformers.modeling_utils import _get_tied_weight_keys

    from .peft import is_peft_model, save_adapter

    save_directory = os.fspath(save_directory)
    model = uncompiled(model)  # a torch.compile wrapper: the model it holds
    merged = None
    if is_peft_model(model):
        if not merge_adapters:
            if state_dict is not None:
                raise ValueError(
                    "zero3: save_pretrained(peft_model, state_dict=...) is not supported; the "
                    "adapter weights are gathered from the model"
                )
            save_adapter(model, save_directory, timeout_s=timeout_s)
            return [os.path.join(save_directory, "adapter_model.safetensors")]
        merged = _merged_entries(model)
        model = model.get_base_model()
    elif merge_adapters:
        raise ValueError(
            "zero3: save_pretrained(..., merge_adapters=True) needs a peft model (PeftModel); "
            "this one has no adapters to merge"
        )
    rank = dist.get_rank()
    agreement = Agreement("zero3_compile.hf.save_pretrained", timeout_s=timeout_s)
    written: list[str] = []
    try:
        if rank == 0:
            os.makedirs(save_directory, exist_ok=True)
            _save_configs(model, save_directory)
        agreement.meet("writing the configuration")
        if merged is not None:
            tensors = merged
        else:
            tensors = _entries(model) if state_dict is None else dict(state_dict)
        tensors = _without_tied(tensors, _get_tied_weight_keys(model))
        keys = sorted(tensors, key=_natural)
        files = _plan(keys, tensors, _bytes(max_shard_size))
        names = _file_names(len(files))
        weight_map = {}
        for name, file_keys in zip(names, files):
            shard_state = {}
            for key in file_keys:
                full = full_tensor(tensors[key])
                if rank == 0:
                    shard_state[key] = full.detach().contiguous().cpu()
                del full
            if rank == 0:
                if save_original_format:
                    shard_state = _revert(model, shard_state, name)
                _write_file(os.path.join(save_directory, name), shard_state)
                weight_map.update({k: name for k in shard_state})
                written.append(os.path.join(save_directory, name))
            del shard_state
            agreement.meet(f"writing {name}")
        if rank == 0:
            _finish(model, save_directory, names, weight_map, tensors)
        agreement.meet("writing the index")
    except BaseException as error:
        agreement.fail(error)
        raise
    return written


class _Merged:
    """A LoRA layer's weight with its adapters merged (``rollout``'s plan entry), gathered and
    merged when its file is written."""

    def __init__(self, item):
        self.item = item

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.item.state.spec.shape)

    def nbytes(self) -> int:
        return _nbytes(self.item.state)

    def full(self) -> torch.Tensor:
        return self.item.merge.apply(full_tensor(self.item.state))


def _merged_entries(model: nn.Module) -> dict:
    """``merge_and_unload()``'s state dict of a peft model, lazily (nothing gathered yet)."""
    from ..rollout.plan import plan

    entries = {}
    for item in plan(model, "merged"):
        if item.merge is not None:
            entries[item.name] = _Merged(item)
        else:  # the shared state of a tied parameter stays shared: written once
            entries[item.name] = item.state if item.state is not None else item.tensor
    return entries


def _save_configs(model: nn.Module, folder: str) -> None:
    config = model.config
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if getattr(model, "can_generate", lambda: False)() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)


def _entries(model: nn.Module) -> dict:
    """What ``state_dict()`` holds, without reading anything yet: the sharded parameters' states
    (gathered one at a time when their file is written; offloaded ones are read then) and the
    other tensors."""
    entries = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in own_parameters(module).items():
            if param is not None:
                entries[dot + name] = state_of(param) or param
        for name, buffer in own_buffers(module).items():
            if buffer is not None and name not in non_persistent_buffer_names(module):
                entries[dot + name] = buffer
    return entries


def _without_tied(tensors: dict, tied_patterns) -> dict:
    """One name per tied parameter (they share one ``ShardedParam``)."""
    groups: dict[int, list[str]] = {}
    for key, value in tensors.items():
        groups.setdefault(id(value), []).append(key)
    patterns = list(tied_patterns or ())
    for names in groups.values():
        if len(names) < 2:
            continue
        targets = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        if len(targets) >= len(names):  # keep one of them whatever the patterns say
            targets = sorted(names)[1:]
        if not targets:
            raise RuntimeError(
                f"zero3: parameters {sorted(names)} are tied, but the model's _tied_weights_keys "
                "do not say which one to save"
            )
        for name in targets:
            tensors.pop(name, None)
    return tensors


def _natural(key: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def _nbytes(value) -> int:
    if isinstance(value, _Merged):
        return value.nbytes()
    if isinstance(value, ShardedParam):
        return value.spec.full_numel * value.local().element_size()
    return value.numel() * value.element_size()


def _plan(keys: list[str], tensors: dict, limit: int) -> list[list[str]]:
    files: list[list[str]] = []
    size = 0
    for key in keys:
        nbytes = _nbytes(tensors[key])
        if not files or (size + nbytes > limit and files[-1]):
            files.append([])
            size = 0
        files[-1].append(key)
        size += nbytes
    return files or [[]]


def _numel(value) -> int:
    if isinstance(value, ShardedParam):
        return value.spec.full_numel
    return math.prod(value.shape)


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"zero3: max_shard_size={size!r}: give bytes, or a size like '2GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@torch.no_grad()
def full_tensor(value) -> torch.Tensor:
    """The whole tensor (a collective for a sharded one: every rank calls it, in key order), in
    the parameter's own dtype (fp32 master weights stay fp32 whatever the compute dtype)."""
    if isinstance(value, _Merged):
        return value.full()
    if isinstance(value, ShardedParam):
        exact = replace(value.spec, param_dtype=None).literal()
        with value.root.active():
            return UNSHARD(value.local(), value.param_id, exact, None)
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def _revert(model, shard_state: dict, name: str) -> dict:
    from transformers.core_model_loading import revert_weight_conversion

    try:
        return revert_weight_conversion(model, shard_state)
    except Exception as error:
        raise RuntimeError(
            f"zero3: could not write {name} in the checkpoint's original layout (a weight "
            f"conversion spans files?): {error}; raise max_shard_size or pass "
            "save_original_format=False"
        ) from error


def _write_file(path: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    staging = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, staging, metadata={"format": "pt"})
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _finish(model, folder: str, names: list[str], weight_map: dict, tensors: dict) -> None:
    pattern = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    for stale in os.listdir(folder):  # shards of an earlier save with another file count
        if (pattern.fullmatch(stale) or stale == WEIGHTS) and stale not in names:
            os.remove(os.path.join(folder, stale))
    index_path = os.path.join(folder, INDEX)
    if len(names) == 1:
        if os.path.exists(index_path):
            os.remove(index_path)
        return
    total_size = sum(_nbytes(v) for v in tensors.values())
    total_parameters = sum(
        _numel(v) for v in tensors.values() if not isinstance(v, torch.Tensor) or
        isinstance(v, nn.Parameter)
    )  # fmt: skip
    index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    staging = f"{index_path}.tmp-{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.replace(staging, index_path)


__all__ = ["save_pretrained"]
