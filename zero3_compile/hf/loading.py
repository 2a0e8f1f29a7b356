"""``from_pretrained``: a Hugging Face model sharded as it loads, each rank reading only its rows.

Hugging Face's own ``from_pretrained`` runs (configuration, dtype, key renames, the weight
converters of the installed transformers such as stacked MoE experts, tied weights, the loading
report); some of its steps are wrapped for the duration of the call:

- ``_load_pretrained_model``: the model it built on the ``meta`` device is sharded first
  (``z3.shard``); then its loader runs with every parameter in ``ShardState.LOADING``. It sees
  ``DTensor`` parameters (this rank's rows), so for each tensor it reads only those rows from the
  safetensors files (``DtensorShardOperation``, shard-on-read through ``get_slice``), and the
  values it assigns are adopted into the shards (``frontend/loading.py``).
  transformers before 5.11 (verl 0.9 pins 5.10) read and assign whole tensors: each one is cut
  to this rank's rows as it is assigned (``_own_rows``), read one at a time, so a rank holds its
  shards plus one whole tensor.
- ``_initialize_missing_keys``: parameters the checkpoint does not hold are initialised by the
  model's own ``_init_weights``, module by module on full-size temporaries (as
  ``z3.materialize``), from rank 0's random state on every rank: the same values as a
  single-process ``from_pretrained`` seeded like rank 0, and the same on every rank. Buffers
  (rotary tables) are initialised by the model as usual.

With parameters offloaded to disk, a shard whose values are exactly its rows of a file (cast to
its dtype) is not written to the store: it reads them from the checkpoint until the first
optimizer step writes its new version (``offload/origins.py``, ``store.FileRows``); the load then
writes nothing, and the first forward reads the checkpoint's (bf16) bytes, not fp32 ones.

Failures on one rank (a damaged file read only by its rows, a shape mismatch of its rows) are
raised on every rank (``agreement.py``), and the model is never returned half loaded: a shard or
buffer still on ``meta`` at the end is an error naming it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.modules import own_parameters
from ..frontend.loading import adopt, loading, sharded_states
from ..frontend.shard import shard
from ..offload import origins
from ..offload.params import deferred_writes
from ..runtime.guard import DEFAULT_TIMEOUT_S
from ..sharding.state import module_state
from .agreement import Agreement
from .generation import mark_sharded
from .rows import RowSlice, header

log = logging.getLogger(__name__)

_SHARD_KEYS = (
    "group",
    "mesh",
    "param_dtype",
    "reduce_dtype",
    "mp_policy",
    "device",
    "leaf_modules",
    "sync_timeout_s",
    "offload",
)
_lock = threading.RLock()
_current: list[_Load] = []  # the load under way (one at a time, under _lock)


class _Load:
    def __init__(self, shard_kwargs: dict, agreement: Agreement):
        self.shard_kwargs = shard_kwargs
        self.agreement = agreement
        self.model: nn.Module | None = None
        self.ignore_mismatched = False
        self.loading: contextlib.ExitStack = contextlib.ExitStack()


def from_pretrained(model_class, pretrained_model_name_or_path, *model_args, **kwargs):
    """``model_class.from_pretrained(path, ...)``, sharded as it loads; every rank calls it.

    ``model_class``: a model class or an ``AutoModel*`` class. Hugging Face's keyword arguments
    (``torch_dtype``/``dtype``, ``config``, ``revision``, ``key_mapping``...) go to it; these go
    to ``z3.shard``: ``group``, ``mesh``, ``mp_policy``, ``param_dtype``, ``reduce_dtype``,
    ``device``, ``leaf_modules``, ``sync_timeout_s``, ``offload``. Not supported with it:
    ``device_map``, ``tp_plan``/``distributed_config``, quantization, DeepSpeed's
    ``HfDeepSpeedConfig`` (the model would be placed or sharded by them instead).

    Example:
        ```python
        model = z3hf.from_pretrained(AutoModelForCausalLM, "path/to/model", torch_dtype=torch.bfloat16)
        model = z3hf.from_pretrained(AutoModelForCausalLM, path, offload=z3.Offload(params="disk"))
        ```
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "zero3: torch.distributed is not initialised; call init_process_group() (torchrun, "
            "accelerate launch) before zero3_compile.hf.from_pretrained"
        )
    shard_kwargs = {k: kwargs.pop(k) for k in _SHARD_KEYS if k in kwargs}
    _refuse(kwargs)
    timeout = shard_kwargs.get("sync_timeout_s", DEFAULT_TIMEOUT_S)
    agreement = Agreement("zero3_compile.hf.from_pretrained", timeout_s=timeout)
    load = _Load(shard_kwargs, agreement)
    with _lock, _wrapped_steps(), _serial_reads(shard_kwargs):
        _current.append(load)  # the wrapped steps find it (the model does not exist yet)
        try:
            model = model_class.from_pretrained(
                pretrained_model_name_or_path, *model_args, **kwargs
            )
            if load.model is None:
                raise RuntimeError(
                    "zero3: transformers built the model without its usual loader (a DeepSpeed or "
                    "distributed configuration is active?): nothing was sharded"
                )
            _check_complete(model)
            agreement.meet("finishing")
        except BaseException as error:
            agreement.fail(error)
            raise
        finally:
            load.loading.close()
            _current.clear()
    mark_sharded(model)
    return model


def _refuse(kwargs: dict[str, Any]) -> None:
    for key in ("device_map", "tp_plan", "tp_size", "distributed_config", "device_mesh"):
        if kwargs.get(key) is not None:
            raise ValueError(
                f"zero3: from_pretrained(..., {key}=...) places or shards the model another way; "
                "zero3 shards it over the data-parallel group (group= or mesh=)"
            )
    if kwargs.get("quantization_config") is not None:
        raise ValueError("zero3: quantized models cannot be sharded by zero3_compile yet")
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "zero3: a DeepSpeed ZeRO-3 configuration is active (HfDeepSpeedConfig or a Trainer "
            "with deepspeed=...); use zero3_compile.hf.Trainer(zero3_config=...) instead of both"
        )


@contextlib.contextmanager
def _serial_reads(shard_kwargs: dict) -> Iterator[None]:
    """With offload, or with a loader that reads whole tensors (``_own_rows``), tensors are read
    one at a time: Hugging Face's thread pool would hold all of this rank's rows (or all whole
    tensors: the model) in memory before the first one reaches its shard or the store."""
    offload = shard_kwargs.get("offload")
    if (offload is None or getattr(offload, "params", None) is None) and _reads_rows():
        yield
        return
    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


@contextlib.contextmanager
def _wrapped_steps() -> Iterator[None]:
    from transformers import PreTrainedModel

    load_weights = PreTrainedModel.__dict__["_load_pretrained_model"]
    initialize = PreTrainedModel.__dict__["_initialize_missing_keys"]

    def load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        load = _current[0] if _current else None
        original = load_weights.__func__
        if load is None or load.model is not None:  # not ours (an adapter, another model)
            return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        load.model = model
        load.ignore_mismatched = bool(getattr(load_config, "ignore_mismatched_sizes", False))
        return _load_weights(
            load, model, lambda sd: original(model, sd, checkpoint_files, load_config, *args,
                                             **kwargs), state_dict, checkpoint_files
        )  # fmt: skip

    def initialize_missing_keys(self, is_quantized):
        load = _current[0] if _current else None
        if load is None or load.model is not self:
            return initialize(self, is_quantized)
        return _initialize_missing(self)

    from transformers import core_model_loading

    set_param = core_model_loading.set_param_for_module

    def set_param_for_module(model, target_name, value, *args, **kwargs):
        load = _current[0] if _current else None
        if load is not None and load.model is model:
            value = _own_rows(model, target_name, value)
        return set_param(model, target_name, value, *args, **kwargs)

    PreTrainedModel._load_pretrained_model = staticmethod(load_pretrained_model)
    PreTrainedModel._initialize_missing_keys = initialize_missing_keys
    core_model_loading.set_param_for_module = set_param_for_module
    try:
        yield
    finally:
        PreTrainedModel._load_pretrained_model = load_weights
        PreTrainedModel._initialize_missing_keys = initialize
        core_model_loading.set_param_for_module = set_param


def _reads_rows() -> bool:
    """Whether the installed transformers' loader reads only a ``DTensor`` parameter's rows
    (5.11 and later); older ones read whole tensors."""
    from transformers import core_model_loading

    return hasattr(core_model_loading, "DtensorShardOperation")


def _own_rows(model, target_name: str, value):
    """What the loader assigns to ``target_name``, as this rank's rows of its parameter.

    transformers 5.11 and later read a ``DTensor`` parameter's rows only and assign them
    (unchanged here). Older loaders (5.10, verl 0.9's pin) know no ``DTensor`` parameters: they
    read the whole tensor and assign it, checking it against the full shape. A plain tensor of
    the parameter's full shape is therefore cut to this rank's rows (a copy: the whole tensor is
    freed once assigned) and handed on as the parameter's ``DTensor``, which passes both
    loaders' shape check and is adopted into the shard like 5.11's."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    owner, _, attr = target_name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return value  # not the model's: the loader reports it
    state = module_state(module)
    param_state = state.params.get(attr) if state is not None else None
    if param_state is None or param_state.layout is not None:  # a buffer; tensor parallel
        return value
    spec, rank = param_state.spec, param_state.rank
    if tuple(value.shape) != spec.shape or tuple(value.shape) == spec.local_shape(rank):
        return value  # this rank's rows already, or a mismatch the loader reports
    rows = spec.chunk(value.detach(), rank)
    return param_state.root.dp.wrap(rows, spec)


def _load_weights(load: _Load, model, read, state_dict, checkpoint_files):
    on_meta = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if on_meta:
        raise RuntimeError(
            f"zero3: transformers built the model with real parameters ({on_meta[0]!r}...), not "
            "on the meta device; this configuration is not supported by "
            "zero3_compile.hf.from_pretrained"
        )
    load.agreement.meet("building the model")
    shard(model, **load.shard_kwargs)
    states = load.loading.enter_context(loading(model))
    try:
        with contextlib.ExitStack() as files, deferred_writes(states):
            if _offloaded_to_disk(states):  # shards read from the files stay in them
                dtypes = {s.local().dtype for s in states}
                files.enter_context(origins.tracking(dtypes.pop() if len(dtypes) == 1 else None))
            if state_dict is None:
                state_dict = _pread_slices(checkpoint_files, files)
            result = read(state_dict)
        if not load.ignore_mismatched:
            _check_report(model, result[0] if isinstance(result, tuple) else result)
    except BaseException as error:
        load.agreement.fail(error)
        raise
    load.agreement.meet("reading its rows of the checkpoint")
    return result


def _offloaded_to_disk(states) -> bool:
    from ..offload.store import DiskStore

    return any(isinstance(getattr(s.root, "offload_store", None), DiskStore) for s in states)


def _pread_slices(checkpoint_files, files: contextlib.ExitStack) -> dict | None:
    """The checkpoint's tensors as lazy slices read with ``pread`` rather than through ``mmap``:
    mapped pages would count in this rank's resident memory beside the shards made from them
    (twice the shards at the peak); a read copies only this rank's rows, in large chunks
    (``rows.RowSlice``). None: not safetensors (Hugging Face's own reading then)."""
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return None
    from safetensors import safe_open

    merged = {}
    for path in checkpoint_files:
        try:
            handle = safe_open(path, framework="pt", device="cpu", backend="pread")
        except TypeError:  # a safetensors without the pread backend: its default (mmap)
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as error:
            raise OSError(f"zero3: cannot read the checkpoint file {path!r}: {error}") from error
        files.enter_context(handle)
        entries, data_start = header(str(path))
        fd = os.open(path, os.O_RDONLY)
        files.callback(os.close, fd)
        for key in handle.keys():
            fallback = functools.partial(handle.get_slice, key)
            merged[key] = RowSlice(
                str(path), fd, entries[key], data_start, fallback, origins.target_dtype()
            )
    return merged


def _check_report(model, info) -> None:
    """Shape mismatches, named with the full shapes (Hugging Face's report compares this
    rank's rows and leaves the names to its log)."""
    mismatched = sorted(getattr(info, "mismatched_keys", ()) or ())
    if not mismatched:
        return
    lines = []
    for key, loaded, expected in mismatched[:5]:
        owner, _, attr = key.rpartition(".")
        state = module_state(model.get_submodule(owner) if owner else model)
        full = state.params[attr].spec.shape if state and attr in state.params else None
        lines.append(
            f"{key}: this rank's rows in the checkpoint have shape {tuple(loaded)}, the model's "
            f"{tuple(expected)} (full shape {full})"
        )
    more = f" and {len(mismatched) - 5} more" if len(mismatched) > 5 else ""
    raise ValueError(
        "zero3: the checkpoint does not match the model's configuration: "
        + "; ".join(lines)
        + more
        + ". Load it with the configuration it was saved with."
    )


# --------------------------------------------------------------------------- missing keys


def _initialize_missing(model) -> None:
    """Hugging Face's ``initialize_weights`` for a sharded model (see the module docstring)."""
    from transformers import PreTrainedModel, initialization

    group = module_state(model).root.dp.shard_group
    guard = initialization.guard_torch_init_functions()  # torch.nn.init respects loaded flags
    with _rank0_random_state(group), torch.no_grad(), guard:
        # the flag the model's initialisers take: is_custom_code() (5.11+), is_remote_code() before
        custom = getattr(model, "is_custom_code", None) or model.is_remote_code
        _visit(model, model._initialize_weights, custom(), PreTrainedModel)


def _visit(module: nn.Module, init, is_custom_code: bool, pretrained_type) -> None:
    """Children first, each sub-model with its own initialiser (``smart_apply``'s order)."""
    for child in module.children():
        if isinstance(child, pretrained_type):
            _visit(child, child._initialize_weights, is_custom_code, pretrained_type)
        else:
            _visit(child, init, is_custom_code, pretrained_type)
    _initialize_module(module, init, is_custom_code)


def _initialize_module(module: nn.Module, init, is_custom_code: bool) -> None:
    if getattr(module, "_is_hf_initialized", False):
        return
    state = module_state(module)
    own = state.params if state is not None else {}
    missing = {a: s for a, s in own.items() if not getattr(s.param, "_is_hf_initialized", False)}
    if not missing:  # loaded parameters (their init functions skip them), buffers
        init(module, is_custom_code)
        return
    # the module's parameters at full size, on a temporary: the missing ones to be initialised,
    # the loaded ones with their values (an initialiser may read them)
    device = state.root.device
    temporaries = {}
    for attr, param_state in own.items():
        if attr in missing:
            full = torch.empty(
                param_state.full_shape, dtype=param_state.local().dtype, device=device
            )
        else:
            with param_state.root.active():
                full = param_state.param.full_tensor()
        temporaries[attr] = nn.Parameter(full, requires_grad=param_state.param.requires_grad)
        if attr not in missing:  # the guarded init functions leave it alone
            temporaries[attr]._is_hf_initialized = True
    saved = {attr: own_parameters(module)[attr] for attr in own}
    own_parameters(module).update(temporaries)  # LOADING: reading module.<attr> gives these
    try:
        init(module, is_custom_code)
        values = {attr: own_parameters(module)[attr].detach() for attr in missing}
    finally:
        own_parameters(module).update(saved)
    for attr, param_state in missing.items():
        adopt(param_state, param_state.spec.chunk(values[attr], param_state.rank))
        param_state.param._is_hf_initialized = True


@contextlib.contextmanager
def _rank0_random_state(group) -> Iterator[None]:
    """Rank 0's CPU (and current CUDA device's) random state on every rank of ``group`` for the
    block; each rank's own state afterwards."""
    own_cpu = torch.get_rng_state()
    own_cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    states = [own_cpu, own_cuda]
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    dist.broadcast_object_list(states, src=src, group=group)
    torch.set_rng_state(states[0])
    if own_cuda is not None and states[1] is not None:
        torch.cuda.set_rng_state(states[1])
    try:
        yield
    finally:
        torch.set_rng_state(own_cpu)
        if own_cuda is not None:
            torch.cuda.set_rng_state(own_cuda)


def _check_complete(model: nn.Module) -> None:
    still = [s.fqn for s in sharded_states(model) if s.local().device.type == "meta"]
    buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if still or buffers:
        names = (still + buffers)[:5]
        raise RuntimeError(
            f"zero3: from_pretrained left {len(still)} parameter(s) and {len(buffers)} buffer(s) "
            f"without values ({names}): neither the checkpoint nor the model's _init_weights "
            "filled them"
        )
