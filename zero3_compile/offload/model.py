"""A model's offload, set up on every rank alike: the options (``Offload``), its stores opened,
its parameter shards registered into the parameter store and its gradients routed into the
gradient spool.

```python
model = z3.shard(model, offload=z3.Offload(params="disk", grads="disk", path="/nvme/run1"))
```
``shard()`` calls ``offload_model`` and ``spool_gradients``; a loader or ``materialize`` that gives
a shard its values calls ``register_loaded``. Each parameter's part is in ``params.py`` (its shard
in a store) and ``grads.py`` (its gradients in the spool); this module is the only one that
uses both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import cluster
from ..cluster import Failure
from . import grads, params
from .store import DiskStore, HostStore, OffloadError

log = logging.getLogger(__name__)

TIERS = ("cpu", "disk")


@dataclass(frozen=True)
class Offload:
    """Where parameter shards and gradient shards live between uses.

    params: "disk" (a file per rank under ``path``: for CPU and accelerator models), "cpu"
        (pinned host memory: for accelerator models; a CPU model is in host memory already, use
        "disk"), or None (no offload).
    grads: the same tiers for gradient shards, from the backward that reduces them to the
        optimizer that reads them (``offload/grads.py``; pair it with ``offload_optimizer``).
    path: folder of the disk tier (default: a private temporary folder removed at exit).
    o_direct: open the file with O_DIRECT (through aligned staging buffers), falling back to
        buffered I/O where the file system refuses it.
    threads: I/O threads of the disk tier.
    poison: debug mode: evicted shards and reloads still in flight hold NaN, so any read that is
        not preceded by its wait shows up as NaN in the results.
    double_buffer: the disk tier writes each new version of a shard beside the current one, so
        an I/O error during a step leaves the previous values (twice the disk). False: one copy,
        rewritten in place; after such an error the lost values refuse to be read (resume from
        a checkpoint). For models whose state fills the disk.

    Example:
        ```python
        model = z3.shard(model, offload=z3.Offload(params="disk", grads="disk", path="/nvme/run1"))
        opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), path="/nvme/run1")
        ```
    """

    params: str | None = None
    grads: str | None = None
    path: str | None = None
    o_direct: bool = False
    threads: int = 4
    poison: bool = False
    double_buffer: bool = True

    def validate(self, device: torch.device) -> None:
        for what in ("params", "grads"):
            tier = getattr(self, what)
            if tier not in (None, *TIERS):
                raise ValueError(f"zero3: Offload({what}={tier!r}) must be 'cpu', 'disk' or None")
            if tier == "cpu" and device.type == "cpu":
                raise ValueError(
                    f"zero3: Offload({what}='cpu') keeps shards in host memory for accelerator "
                    f"models; this model already lives in host memory. Use Offload({what}="
                    "'disk') to move idle shards out of memory."
                )
        if not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError(
                f"zero3: Offload(threads=...) must be an int >= 1, got {self.threads!r}"
            )


def open_store(root, offload: Offload, device: torch.device, what: str = "params"):
    """The offload store of a model's parameter shards (``what="grads"``: its gradient spool's);
    every rank raises if any rank failed (an unwritable path or a full disk on one rank must not
    leave the others waiting)."""
    offload.validate(device)
    failure, store = None, None
    try:
        store = (
            HostStore()
            if getattr(offload, what) == "cpu"
            else DiskStore(
                offload.path,
                what,
                dist.get_rank(),
                threads=offload.threads,
                o_direct=offload.o_direct,
                double_buffer=offload.double_buffer,
            )
        )
    except OffloadError as error:
        failure = error
    agree(root.dp.shard_group, failure)
    return store


def offload_model(root, states: list, offload: Offload, device: torch.device) -> None:
    """Open the store and evict every shard of ``states`` into it (see ``open_store``)."""
    root.offload_store = open_store(root, offload, device)
    failure = None
    try:
        for state in states:
            params.register(state, root.offload_store, offload.poison)
    except OffloadError as error:
        failure = error
    agree(root.dp.shard_group, failure)
    log.debug(
        "zero3: offloaded %d parameter shards (%.1f MiB) to %s",
        len(states),
        sum(s.offload.nbytes for s in states) / 2**20,
        offload.params,
    )


def spool_gradients(root, states: list, offload: Offload, device: torch.device) -> None:
    """Give a model a gradient spool and route every parameter's gradients into it; every rank
    raises if any rank could not open it."""
    root.grad_spool = grads.GradSpool(open_store(root, offload, device, what="grads"))
    for state in states:
        grads.route_gradients(state)


def register_loaded(state) -> None:
    """A shard that just received its values (``materialize``, a loader): into the model's
    offload store, if it has one, and out of memory; its gradients into the model's spool."""
    root = state.root
    if getattr(root, "grad_spool", None) is not None:
        grads.register(state)
    store = getattr(root, "offload_store", None)
    if store is None or state.offload is not None:
        return
    params.register(state, store, root.offload.poison)


def agree(group, failure: Exception | None, what: str = "set up its offload store") -> None:
    """Every rank of ``group`` raises if one failed (``failure`` on this rank): the rank that
    failed its own error, the others an ``OffloadError`` naming each failed rank and its reason
    (``cluster.agree``)."""

    def error(failures: list[Failure]) -> OffloadError:
        listed = "; ".join(map(str, failures))
        return OffloadError(0, f"zero3: another rank could not {what}: {listed}")

    try:
        cluster.agree(failure=failure, over=group, error=error, what=what)
    except OffloadError:
        if failure is not None:
            raise failure from None
        raise
