"""Gradient shards that live in an offload store from the moment the backward produces them
until the optimizer reads them: ``Offload(grads="disk")``.

```python
model = z3.shard(model, offload=z3.Offload(params="disk", grads="disk", path="/nvme/run1"))
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), tier="disk", path="/nvme/run1")
```
Without it a rank holds every gradient shard from the backward that computes it to the
optimizer step: at 3B parameters on 2 ranks, 6.4 GB of fp32 per rank, the largest item of the
step. With it, each reduced shard is written to the model's gradient spool as soon as its bucket
is reduced (``zero3::spool_grad`` in the backward graph, right after the copy-out) and
``param.grad`` is a ``SpooledGrad``: a tensor of the gradient's shape and dtype that holds no
memory, whose values are one immutable version in the spool.

Reading such a gradient gives its exact values; nothing is silently approximated:
- ``z3.offload_optimizer`` reads the gradients of each tile with its optimizer state and steps
  them like any other;
- ``torch.nn.utils.clip_grad_norm_`` needs no I/O: the 2-norm of every version is computed when it
  is written, and a multiplication by a scalar is kept as a pending factor applied on the next
  read (in the same order, so results are bit-identical to gradients in memory);
- any other operation reads the version into a temporary, runs, and an in-place one writes the
  result as a new version (``p.grad.add_(...)``, accumulation over micro-batches, ``copy_``);
- ``zero_grad(set_to_none=False)`` makes it zeros without I/O; ``set_to_none=True`` drops it and
  its space in the spool is reused.

A plain optimizer over spooled gradients is correct but reads every gradient for each of its
operations (a foreach optimizer reads all of them at once): wrap it with ``offload_optimizer``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict
from concurrent.futures import Future

import torch
from torch.distributed.tensor import DTensor

from .._torch.dtensor import local_tensor
from .._torch.pytree import tree_map
from .._torch.tensors import storage_key
from .access import written_arguments
from .deferred import wrapper_tensor
from .store import DiskStore, HostStore, OffloadError, Region

log = logging.getLogger(__name__)
aten = torch.ops.aten

# gradient bytes whose writes may be in flight before the backward waits for the disk
IN_FLIGHT_BYTES = 256 * 2**20


class GradSpool:
    """The gradient versions of one model, in regions of one store reused by size."""

    def __init__(self, store: DiskStore | HostStore, in_flight_bytes: int = IN_FLIGHT_BYTES):
        self.store = store
        self.in_flight_limit = in_flight_bytes
        self.in_flight = 0
        self.lock = threading.RLock()  # released regions come back from finalizers and I/O threads
        self.room = threading.Condition(self.lock)
        self.free: dict[int, list[Region]] = defaultdict(list)
        self.versions_written = 0

    def write(self, tensor: torch.Tensor, norms: bool = True) -> _Version:
        """A new version holding ``tensor``'s values (written on the store's threads)."""
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        with self.lock:
            regions = self.free[nbytes]
            region = regions.pop() if regions else None
        if region is None:
            region = self.store.allocate(nbytes, slots=1)
        norm = torch.linalg.vector_norm(tensor, 2.0) if norms else None
        with self.room:  # bound the memory held by writes not done yet
            while self.in_flight and self.in_flight + nbytes > self.in_flight_limit:
                self.room.wait()
            self.in_flight += nbytes
        future = self.store.pool.submit(self.store.write_current, region, tensor)
        future.add_done_callback(lambda _: self._written(nbytes))
        self.versions_written += 1
        return _Version(self, region, future, norm)

    def _written(self, nbytes: int) -> None:
        with self.room:
            self.in_flight -= nbytes
            self.room.notify_all()

    def release(self, region: Region, future: Future) -> None:
        def give(_=None) -> None:
            with self.lock:
                self.free[region.nbytes].append(region)

        if future.done():
            give()
        else:
            future.add_done_callback(give)

    def close(self) -> None:
        self.store.close()


class _Version:
    """One written version of a gradient shard (immutable; its region is reused once no
    ``SpooledGrad`` refers to it)."""

    __slots__ = ("spool", "region", "future", "norm")

    def __init__(self, spool: GradSpool, region: Region, future: Future, norm):
        self.spool, self.region, self.future, self.norm = spool, region, future, norm

    def read_into(self, out: torch.Tensor) -> None:
        self._written_or_raise()
        self.spool.store.read(self.region, out)

    def _written_or_raise(self) -> None:
        error = self.future.exception()  # waits for the write
        if error is not None:
            raise OffloadError(
                getattr(error, "errno", 0) or 0,
                f"zero3: a gradient could not be written to the offload store: {error}",
            ) from error

    def read_part_into(self, out: torch.Tensor, start: int) -> None:
        """Read ``out``'s bytes from byte ``start`` of the version."""
        self._written_or_raise()
        self.spool.store.read_part(self.region, out, start)

    def __del__(self) -> None:
        try:
            self.spool.release(self.region, self.future)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Applied:
    """The content of a gradient an optimizer stepped with during the backward
    (``optim/in_backward.py``): reading, scaling or zeroing it asks ``check``, which raises what
    that would break (zeroing is allowed once the step is committed)."""

    norm = None

    def check(self, what: str) -> None:
        raise NotImplementedError

    def read_into(self, out: torch.Tensor) -> None:
        self.check("read")

    def read_part_into(self, out: torch.Tensor, start: int) -> None:
        self.check("read")


class _Cell:
    """What a gradient and its aliases (``detach``, ``view``) hold: the current version and the
    multiplications pending on it; an in-place operation on any alias changes it for all."""

    __slots__ = ("content", "factors")

    def __init__(self, content: _Version | None, factors: tuple = ()):
        self.content = content  # None: zeros
        self.factors = factors  # pending multiplications, applied in order on the next read


class SpooledGrad(torch.Tensor):
    """A gradient shard whose values are in a ``GradSpool`` (see the module docstring)."""

    _spool: GradSpool
    _cell: _Cell

    @staticmethod
    def __new__(cls, spool, cell, shape, dtype, device):
        self = wrapper_tensor(cls, shape, dtype, device)
        self._spool = spool
        self._cell = cell
        return self

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def holding(cls, spool: GradSpool, content, like: torch.Tensor) -> SpooledGrad:
        """A gradient of ``like``'s shape, dtype and device whose content is ``content``: a
        version ``spool.write`` returned, an ``Applied`` or None (zeros)."""
        return cls(spool, _Cell(content), like.shape, like.dtype, like.device)

    @property
    def content(self) -> _Version | Applied | None:
        """What the gradient holds: its written version, an ``Applied`` (stepped during the
        backward) or None (zeros)."""
        return self._cell.content

    @property
    def _factors(self) -> tuple:
        return self._cell.factors

    def __repr__(self, *, tensor_contents=None) -> str:
        where = "zeros" if self.content is None else "offloaded"
        return f"SpooledGrad(shape={tuple(self.shape)}, dtype={self.dtype}, {where})"

    def _alias(self) -> SpooledGrad:
        return SpooledGrad(self._spool, self._cell, self.shape, self.dtype, self.device)

    def _copy(self) -> SpooledGrad:
        # versions are immutable: a copy refers to the same one until either is written
        cell = _Cell(self.content, self._factors)
        return SpooledGrad(self._spool, cell, self.shape, self.dtype, self.device)

    def _set(self, version: _Version | None) -> None:
        self._cell.content, self._cell.factors = version, ()

    def _scale(self, factor) -> None:
        if _is_one(factor):  # changes no value (clip_grad_norm_ under its bound multiplies by 1)
            return
        if isinstance(self.content, Applied):
            self.content.check("scaled")
        self._cell.factors = (*self._cell.factors, _factor(factor))

    def materialize(self) -> torch.Tensor:
        """The values, read into a tensor of their own (pending factors applied)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if self.content is None:
            return out.zero_()
        self.content.read_into(out)
        for factor in self._factors:
            out.mul_(factor)
        return out

    def materialize_part(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``start .. start + out.numel()`` of the flattened values (factors applied),
        read into ``out``."""
        if self.content is None:
            return out.zero_()
        self.content.read_part_into(out, start * self.element_size())
        for factor in self._factors:
            out.mul_(factor)
        return out

    def _norm(self):
        """The 2-norm without reading, where it is known exactly."""
        if self.content is None or self._factors or self.content.norm is None:
            return None
        return self.content.norm.clone()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _read_and_run(func, args, kwargs)


def _is_scalar(value) -> bool:
    if isinstance(value, SpooledGrad):
        return False
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (int, float, bool))


def _is_one(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_meta and bool(value == 1)
    return value == 1


def _factor(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _alias(self, *args, **kwargs):
    return self._alias()


def _copy(self, *args, **kwargs):
    return self._copy()


def _view(self, size):
    # DTensor.from_local wraps ``local.view_as(local)``
    if tuple(size) != tuple(self.shape):
        return NotImplemented
    return self._alias()


def _zero_(self):
    if isinstance(self.content, Applied):
        self.content.check("zeroed")
    self._set(None)
    return self


def _foreach_zero_(tensors):
    """``zero_grad(set_to_none=False)`` of a fused or foreach optimizer: no reads."""
    for tensor in tensors:
        if isinstance(tensor, SpooledGrad):
            _zero_(tensor)
        else:
            tensor.zero_()
    return None


def _add_(self, other, alpha=1):
    """Autograd accumulating a stepped gradient into zeros (``zero_grad(set_to_none=False)``):
    the placeholder itself."""
    applied = isinstance(other, SpooledGrad) and isinstance(other.content, Applied)
    if not (applied and isinstance(self, SpooledGrad) and self.content is None and alpha == 1):
        return NotImplemented
    self._set(other.content)
    return self


def _mul_(self, other):
    if not _is_scalar(other):
        return NotImplemented
    self._scale(other)
    return self


def _foreach_mul_(tensors, other):
    if isinstance(other, (list, tuple)):
        if len(other) != len(tensors) or not all(_is_scalar(o) for o in other):
            return NotImplemented
        factors = list(other)
    elif _is_scalar(other):
        factors = [other] * len(tensors)
    else:
        return NotImplemented
    for tensor, factor in zip(tensors, factors):
        if isinstance(tensor, SpooledGrad):
            tensor._scale(factor)
        else:
            tensor.mul_(factor)
    return None


def _add(self, other, alpha=1):
    """Two gradients of one parameter summed by autograd (a parameter used twice): spooled."""
    if not (isinstance(self, SpooledGrad) and isinstance(other, SpooledGrad)):
        return NotImplemented
    if self.shape != other.shape or self.dtype != other.dtype:
        return NotImplemented
    total = torch.add(self.materialize(), other.materialize(), alpha=alpha)
    return SpooledGrad.holding(self._spool, self._spool.write(total), total)


def _vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    if ord != 2 or dim is not None or keepdim or dtype is not None:
        return NotImplemented
    norm = self._norm()
    return NotImplemented if norm is None else norm


def _foreach_norm(tensors, ord=2, dtype=None):
    # CPU's foreach norm is linalg_vector_norm per tensor: the norm computed at write time
    if ord != 2 or dtype is not None:
        return NotImplemented
    out = []
    for tensor in tensors:
        norm = tensor._norm() if isinstance(tensor, SpooledGrad) else None
        if norm is None:
            if tensor.device.type != "cpu":
                return NotImplemented
            value = tensor.materialize() if isinstance(tensor, SpooledGrad) else tensor
            norm = torch.linalg.vector_norm(value, ord)
        out.append(norm)
    return out


_HANDLERS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _copy,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.zero_.default: _zero_,
    aten._foreach_zero_.default: _foreach_zero_,
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add_,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten._foreach_mul_.Tensor: _foreach_mul_,
    aten._foreach_mul_.Scalar: _foreach_mul_,
    aten._foreach_mul_.ScalarList: _foreach_mul_,
    aten._foreach_mul_.List: _foreach_mul_,
    aten.linalg_vector_norm.default: _vector_norm,
}
_FOREACH_NORM = getattr(aten, "_foreach_norm", None)
if _FOREACH_NORM is not None:
    _HANDLERS[_FOREACH_NORM.Scalar] = _foreach_norm

_warned_bulk_read = False


def _read_and_run(func, args, kwargs):
    """Any other operation: read the spooled values, run it, store what it wrote."""
    global _warned_bulk_read
    read: dict[int, tuple[SpooledGrad, torch.Tensor]] = {}

    def unwrap(value):
        if isinstance(value, SpooledGrad):
            if id(value) not in read:
                read[id(value)] = (value, value.materialize())
            return read[id(value)][1]
        return value

    plain_args, plain_kwargs = tree_map(unwrap, (args, kwargs))
    if len(read) > 1 and not _warned_bulk_read and "_foreach_" in str(func):
        _warned_bulk_read = True
        log.warning(
            "zero3: %s read %d offloaded gradients into memory at once; wrap the optimizer "
            "with zero3_compile.offload_optimizer to step them tile by tile",
            func,
            len(read),
        )
    out = func(*plain_args, **plain_kwargs)
    written = {id(t) for t in written_arguments(func, args, kwargs)}
    by_value = {}
    for key, (spooled, value) in read.items():
        if key in written:
            spooled._set(spooled._spool.write(value))
        by_value[id(value)] = spooled
    return tree_map(lambda o: by_value.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)


# --------------------------------------------------------------------------- parameters


_by_storage: dict = {}  # storage of a shard whose gradients are spooled -> its ShardedParam
_lock = threading.Lock()


def register(state) -> None:
    """Route ``state``'s gradients into its model's spool (again after its storage changed)."""
    with _lock:
        _by_storage[storage_key(state.local())] = state


def state_of_storage(shard: torch.Tensor):
    key = storage_key(shard)
    with _lock:
        state = _by_storage.get(key)
        # a key whose storage died (a shard re-registered after its storage changed) can equal
        # a new storage at the same address: only the state whose shard is that storage counts
        if state is not None and storage_key(state.local()) != key:
            del _by_storage[key]
            return None
        return state


def spool(state, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` (a shard of ``state``'s gradient) as a ``SpooledGrad`` in its model's spool."""
    grad_spool = state.root.grad_spool
    if isinstance(grad, SpooledGrad):
        return grad
    version = grad_spool.write(grad)
    return SpooledGrad.holding(grad_spool, version, grad)


def spool_grad(grad: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """The body of ``zero3::spool_grad``: the reduced gradient shard of the parameter whose
    shard is ``shard``, spooled (returned as it is if that parameter is not known here: the
    parameter's hook spools it once it is accumulated)."""
    state = state_of_storage(shard)
    if state is None or getattr(state.root, "grad_spool", None) is None:
        return grad.clone()
    taker = _takers.get(state)
    if taker is not None:
        return taker(state, grad)
    return spool(state, grad)


_takers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ShardedParam -> taker


def take_gradients(state, taker) -> None:
    """``taker(state, grad)`` receives ``state``'s reduced gradient shards in the backward
    instead of the spool, and returns what stands for them (``optim/in_backward.py``)."""
    _takers[state] = taker


# gradients the backward left in memory and the parameter's hook spooled (the compiled
# backward spools its own: tests check it left none)
spooled_by_hook = 0


def _spool_accumulated(state):
    def hook(param) -> None:
        """Whatever produced this gradient (eager code, another backend): into the spool."""
        global spooled_by_hook
        grad = param.grad
        # sync off: param.grad is the pending placeholder (frontend/pending.py), the gradients
        # are elsewhere until they are reduced (and spooled then)
        if grad is None or not state.requires_sync:
            return
        local = local_tensor(grad) if isinstance(grad, DTensor) else grad
        if isinstance(local, SpooledGrad):
            return
        spooled_by_hook += 1
        param.grad = with_local(param, spool(state, local))

    return hook


def route_gradients(state) -> None:
    """Route ``state``'s gradients into its model's spool: the backward's reduced shards (found
    by the shard's storage) and whatever else accumulates into ``param.grad`` (a hook)."""
    register(state)
    _hook(state.param, _spool_accumulated(state))


def _hook(param, hook) -> None:
    """``hook`` after each accumulation into ``param.grad``, also for a frozen parameter (a LoRA
    base) that training unfreezes later: torch refuses to register the hook while the parameter
    requires no gradient, but keeps it and runs it once the parameter requires one."""
    frozen = not param.requires_grad
    if frozen:
        param.requires_grad_(True)
    try:
        param.register_post_accumulate_grad_hook(hook)
    finally:
        if frozen:
            param.requires_grad_(False)


def spooled(param) -> SpooledGrad | None:
    """The ``SpooledGrad`` of ``param.grad``, or None."""
    grad = param.grad
    local = local_tensor(grad) if isinstance(grad, DTensor) else grad
    return local if isinstance(local, SpooledGrad) else None


def with_local(param, local: torch.Tensor) -> torch.Tensor:
    """A gradient for ``param`` holding ``local`` (a DTensor like the parameter)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return local


__all__ = ["Applied", "GradSpool", "SpooledGrad", "route_gradients", "take_gradients"]
