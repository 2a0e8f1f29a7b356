"""A model's and its optimizer's states moved out of memory on demand, and back:
``offload_states`` / ``reload_states``.

```python
z3.offload_states(model, optimizer)          # parameter shards, gradients, optimizer state
outputs = rollout_engine.generate(prompts)   # the accelerator's memory is the rollout's
z3.reload_states(model, optimizer)           # bit-identical; training goes on as if never moved
```
RLHF loops alternate a training phase and a generation phase on the same devices (DeepSpeed's
``engine.offload_states()`` / ``reload_states()``, verl's ``engine.to("cpu")`` between rollout and
training). What moves (``include``; DeepSpeed's names accepted):

- ``"params"`` (``"hp_params"``, ``"lp_params"``): every parameter shard not offloaded by
  ``shard(offload=...)`` already;
- ``"grads"`` (``"lp_grads"``): gradient shards held in memory (not ``Offload(grads=...)``'s);
- ``"optim_states"``: the optimizer's state tensors (not those ``offload_optimizer`` keeps in its
  store between steps);
- ``"contiguous_grad_buffer"``: accepted; zero3 keeps no gradient buckets between steps.

``device="cpu"``: host memory (pinned unless ``pin_memory=False``), for accelerator models; a CPU
model's tensors are in host memory already and stay. ``device="disk"``: a file per rank under
``path`` (a private temporary folder by default), for any model.

Objects keep their identity where others hold them: a parameter stays the same ``DTensor`` (the
model, the optimizer's groups and state keys, compiled graphs refer to it) whose storage is given
back (resized to zero bytes, as ``shard(offload=...)`` does between uses); a gradient and an
optimizer state tensor are replaced by ``DTensor``s of the same layout holding no memory, and by
new tensors on reload. Meanwhile every value stays readable and writable through the tensor API
(``p.full_tensor()``, ``optimizer.state[p]["exp_avg"].to_local()``, ``p.copy_(...)``, eager
calls of the model: ``access.py``); a graph compiled for the model refuses to run until
``reload_states`` (its all-gathers would read the shards' memory). On an accelerator the freed
memory goes back to the device (``torch.accelerator.empty_cache()``). The stores' space is kept
for the next cycle.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch.dtensor import local_tensor, spec_of
from ..sharding.state import ShardState, state_of
from .access import LiveTensor
from .model import agree
from .params import register, unregister
from .store import DiskStore, HostStore, OffloadError, Region

log = logging.getLogger(__name__)

KINDS = ("params", "grads", "optim_states")
_ALIASES = {
    "hp_params": "params",
    "lp_params": "params",
    "lp_grads": "grads",
    "contiguous_grad_buffer": None,  # nothing of the kind between steps
}
DEVICES = ("cpu", "disk")


def offload_states(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    include: Iterable[str] | None = None,
    device: str = "cpu",
    path: str | None = None,
    pin_memory: bool = True,
    non_blocking: bool = False,
) -> None:
    """Move what ``model`` (sharded by ``zero3_compile.shard``) and ``optimizer`` hold in memory
    to ``device`` ("cpu": host memory, for accelerator models; "disk": a file per rank under
    ``path``) until ``reload_states``; see the module docstring. ``include``: some of
    "params", "grads", "optim_states" (default: all; DeepSpeed's names accepted). Idempotent:
    what is offloaded already stays where it is.

    ```python
    z3.offload_states(model, optimizer, device="cpu")    # before the rollout
    z3.reload_states(model, optimizer)                   # before the next training step
    ```
    """
    kinds = _kinds(include)
    if device == "nvme":
        device = "disk"
    if device not in DEVICES:
        raise ValueError(f"zero3: offload_states(device={device!r}) must be 'cpu' or 'disk'")
    states = _sharded_states(model)
    _check_between_steps(states)
    parking = _parking(states)
    moved: list[torch.device] = []
    with _agreed(states):  # a full disk on one rank raises on every rank
        _move_out(parking, states, optimizer, kinds, device, path, pin_memory, non_blocking, moved)
    _release(moved, non_blocking)
    log.debug("zero3: offloaded %d tensors to %s", len(moved), device)


def _move_out(parking, states, optimizer, kinds, device, path, pin_memory, non_blocking, moved):
    if "params" in kinds:
        for state in states:
            if state.offload is None and _movable(_local(state.param), device):
                store = parking.store(device, path, pin_memory)
                region = parking.param_regions.get(state)
                region = region if region is not None and _in(store, region) else None
                register(state, store, False, region=region, non_blocking=non_blocking)
                parking.param_regions[state] = state.offload.region
                parking.params[state] = store
                moved.append(state.param.device)
    if "grads" in kinds:
        for state in states:
            grad = state.param.grad
            if isinstance(grad, DTensor) and _movable(local_tensor(grad), device):
                parked = parking.park(("grad", state), grad, device, path, pin_memory, non_blocking)
                state.param.grad = parked
                moved.append(grad.device)
    if "optim_states" in kinds and optimizer is not None and not _offloaded(optimizer):
        for param, entry in _optimizer_entries(optimizer, states):
            for key, value in list(entry.items()):
                if isinstance(value, DTensor) and _movable(local_tensor(value), device):
                    handle = ("state", weakref.ref(optimizer), state_of(param), key)
                    entry[key] = parking.park(handle, value, device, path, pin_memory, non_blocking)
                    moved.append(value.device)


def reload_states(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    include: Iterable[str] | None = None,
    non_blocking: bool = False,
) -> None:
    """Bring back what ``offload_states`` moved out for ``model``, bit-identical: ``include``
    as there (default: everything); the optimizer state of ``optimizer`` only, if given (else
    of every optimizer it moved). Idempotent.

    ```python
    z3.reload_states(model, include=["params"])    # log-probabilities need the weights only
    z3.reload_states(model, optimizer)             # everything, before the training step
    ```
    """
    kinds = _kinds(include)
    states = _sharded_states(model)
    parking = _parking(states, create=False)
    if parking is None:
        return
    devices: list[torch.device] = []
    with _agreed(states):
        _move_back(parking, kinds, optimizer, devices)
    if devices and not non_blocking:
        _synchronize(devices)


def _move_back(parking, kinds, optimizer, devices) -> None:
    for state in list(parking.params) if "params" in kinds else []:
        if state.offload is not None and state.offload.store is parking.params[state]:
            unregister(state)
            devices.append(state.param.device)
        del parking.params[state]
    for handle, parked in list(parking.parked.items()):
        if handle[0] == "grad" and "grads" not in kinds:
            continue
        if handle[0] == "state" and (
            "optim_states" not in kinds or (optimizer is not None and handle[1]() is not optimizer)
        ):
            continue
        restored = parked.values.restore()
        devices.append(restored.device)
        _put_back(handle, parked, restored)
        del parking.parked[handle]


@contextlib.contextmanager
def _agreed(states) -> Iterator[None]:
    """Every rank of the model raises if one failed to move its states (``OffloadError``)."""
    failure = None
    try:
        yield
    except OffloadError as error:
        failure = error
    agree(states[0].root.dp.shard_group, failure, "move its states")


# --------------------------------------------------------------------------- what is parked


class _ParkedValues:
    """The values of a gradient or optimizer state tensor in a parking store
    (``access.OffloadedValues``); after ``restore`` the restored tensor's."""

    def __init__(self, store, region: Region, like: torch.Tensor, name: str):
        self.store, self.region, self.name = store, region, name
        self.key = self
        self.device = like.device
        self.meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
        self.restored: torch.Tensor | None = None

    def evicted(self) -> bool:
        return self.restored is None

    def tensor(self) -> torch.Tensor:
        return self.meta if self.restored is None else self.restored

    def storage(self) -> torch.UntypedStorage:
        if self.restored is None:
            return torch.UntypedStorage(0, device=self.device)
        return self.restored.untyped_storage()

    def read(self) -> torch.Tensor:
        if self.restored is not None:
            return self.restored
        out = torch.empty_strided(
            self.meta.shape, self.meta.stride(), dtype=self.meta.dtype, device=self.device
        )
        self.store.read(self.region, out)
        return out

    @contextlib.contextmanager
    def writing(self) -> Iterator[torch.Tensor]:
        if self.restored is not None:
            yield self.restored
            return
        values = self.read()
        yield values
        self.store.write_current(self.region, values)

    def refuse_graphs(self) -> str | None:
        return None

    def restore(self) -> torch.Tensor:
        self.restored = self.read()
        return self.restored


class _Parked:
    """One parked gradient or state tensor: the object standing for it, and its values."""

    def __init__(self, standing: DTensor, values: _ParkedValues):
        self.standing, self.values = standing, values


class _Parking:
    """What ``offload_states`` moved out of one model (and its optimizers' state): stores per
    device, and each tensor's region, kept for the next cycle."""

    def __init__(self, rank: int):
        self.rank = rank
        self.stores: dict[str, DiskStore | HostStore] = {}
        self.params: dict = {}  # ShardedParam -> the store holding its shard now
        self.param_regions: dict = {}  # ShardedParam -> its region (reused)
        self.parked: dict = {}  # handle -> _Parked
        self.regions: dict = {}  # handle -> its region (reused)

    def store(self, device: str, path: str | None, pin_memory: bool):
        if device not in self.stores:
            self.stores[device] = (
                HostStore(slots=1, pin_memory=pin_memory)
                if device == "cpu"
                else DiskStore(path, "states", self.rank, double_buffer=False)
            )
        return self.stores[device]

    def park(self, handle, value: DTensor, device, path, pin_memory, non_blocking) -> DTensor:
        """``value``'s values into a region; the ``DTensor`` that stands for them."""
        store = self.store(device, path, pin_memory)
        local = local_tensor(value).detach().contiguous()
        nbytes = local.numel() * local.element_size()
        region = self.regions.get(handle)
        if region is None or region.nbytes != nbytes or not _in(store, region):
            region = self.regions[handle] = store.allocate(nbytes)
        store.write_current(region, local, non_blocking=non_blocking)
        name = "gradient" if handle[0] == "grad" else f"optimizer state {handle[-1]!r}"
        values = _ParkedValues(store, region, local, name)
        standing = DTensor(LiveTensor(values), spec_of(value), requires_grad=False)
        self.parked[handle] = _Parked(standing, values)
        return standing


def _in(store, region: Region) -> bool:
    buffers = getattr(region, "buffers", None)
    return isinstance(store, HostStore) == (buffers is not None)


def _put_back(handle, parked: _Parked, restored: torch.Tensor) -> None:
    """The restored values where the standing tensor is (unless something replaced it)."""
    value = DTensor(restored, spec_of(parked.standing), requires_grad=False)
    if handle[0] == "grad":
        param = handle[1].param
        if param.grad is parked.standing:
            param.grad = value
        return
    _, optimizer_ref, state, key = handle
    optimizer = optimizer_ref()
    entry = None if optimizer is None else optimizer.state.get(state.param)
    if entry is not None and entry.get(key) is parked.standing:
        entry[key] = value


# --------------------------------------------------------------------------- helpers


def _kinds(include) -> set[str]:
    if include is None:
        return set(KINDS)
    if isinstance(include, str):
        include = [include]
    kinds = set()
    for item in include:
        name = getattr(item, "value", item)  # DeepSpeed's OffloadStateTypeEnum
        name = _ALIASES.get(name, name)
        if name is None:
            continue
        if name not in KINDS:
            known = ", ".join(repr(k) for k in (*KINDS, *_ALIASES))
            raise ValueError(f"zero3: offload_states(include=...) got {item!r}; known: {known}")
        kinds.add(name)
    return kinds


def _sharded_states(model: nn.Module) -> list:
    states, seen = [], set()
    for param in model.parameters():
        state = state_of(param)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    if not states:
        raise ValueError(
            "zero3: offload_states / reload_states need a model sharded by zero3_compile.shard"
        )
    return states


def _check_between_steps(states) -> None:
    for state in states:
        if state.state is not ShardState.SHARDED:
            raise RuntimeError(
                f"zero3: offload_states() while {state.fqn!r} is {state.state.name.lower()} "
                "(inside z3.gathered(), or gradients accumulating with gradient sync off); call "
                "it between optimizer steps"
            )


def _parking(states, create: bool = True) -> _Parking | None:
    """The model's parking (on its runtime; ``create``: made if it has none yet)."""
    root = states[0].root
    parking = getattr(root, "parked_states", None)
    if parking is None and create:
        rank = dist.get_rank() if dist.is_initialized() else 0
        parking = root.parked_states = _Parking(rank)
    return parking


def _local(param) -> torch.Tensor:
    return local_tensor(param) if isinstance(param, DTensor) else param


def _movable(local: torch.Tensor, device: str) -> bool:
    """Whether ``local`` holds memory ``device`` would take: a plain tensor with storage (not
    a value some store holds already), on an accelerator for "cpu"."""
    if type(local) is not torch.Tensor:
        return False  # spooled, stored, parked already
    if local.untyped_storage().nbytes() == 0 and local.numel() > 0:
        return False  # offloaded already
    if device == "cpu" and local.device.type == "cpu":
        return False  # in host memory already
    return True


def _offloaded(optimizer) -> bool:
    """``offload_optimizer``'s state is in its store between steps already."""
    return bool(getattr(optimizer, "_zero3_tiled", False))


def _optimizer_entries(optimizer, states) -> list:
    mine = {id(s.param) for s in states}
    return [
        (param, optimizer.state[param])
        for group in optimizer.param_groups
        for param in group["params"]
        if id(param) in mine and optimizer.state.get(param)
    ]


def _release(devices: list[torch.device], non_blocking: bool) -> None:
    """Give freed accelerator memory back to the device (the copies out done first)."""
    if any(d.type != "cpu" for d in devices):
        if not non_blocking:
            _synchronize(devices)
        torch.accelerator.empty_cache()


def _synchronize(devices) -> None:
    if any(torch.device(d).type != "cpu" for d in devices):
        torch.accelerator.synchronize()


__all__ = ["offload_states", "reload_states"]
