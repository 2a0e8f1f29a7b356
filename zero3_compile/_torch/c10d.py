"""torch.distributed internals: functional collective ops, groups by name, side gloo groups."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

funcol = torch.ops._c10d_functional

ALL_GATHER = funcol.all_gather_into_tensor.default
REDUCE_SCATTER = funcol.reduce_scatter_tensor.default
ALL_REDUCE = funcol.all_reduce.default
# Inductor's re-inplacing turns all_reduce into all_reduce_ in the graphs it compiles
ALL_REDUCE_INPLACE = funcol.all_reduce_.default
WAIT = funcol.wait_tensor.default
# compressed gradient reductions (ZeRO++'s qgZ): each rank's quantized rows to their owner
ALL_TO_ALL = funcol.all_to_all_single.default
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_REDUCE_INPLACE, ALL_TO_ALL)


def side_all_gather(out: torch.Tensor, inp: torch.Tensor, group, timeout_s: float) -> None:
    """Eager all-gather on a side group (``gloo_side_group``) with a bounded wait.

    The group is a bare gloo backend (not registered with ``torch.distributed``), driven through
    its own ``_allgather_base`` (2.11-2.14). ``Work.wait(timeout)`` raises on gloo once the
    timeout passes (checked 2.13, 2.14).
    """
    work = group._allgather_base(out, inp)
    work.wait(timedelta(seconds=timeout_s))


def gloo_side_group(prefix: str, ranks: list[int], timeout_s: float):
    """A gloo communicator of ``ranks`` (global ranks) that only those ranks create.

    ``dist.new_group`` must be entered by every rank of the job (or, with
    ``use_local_synchronization``, derives its store keys from how many groups each process made
    before, which differs between pipeline stages); torch's own debug wrapper builds its helper
    group the way done here: a ``ProcessGroupGloo`` over a ``PrefixStore`` of the default store,
    under a prefix the members agree on. Private constructor, stable 2.11-2.14.
    """
    from torch._C._distributed_c10d import ProcessGroupGloo

    store = default_store()
    if store is None:
        raise RuntimeError("zero3: the default process group has no store to rendezvous in")
    me = ranks.index(dist.get_rank())
    return ProcessGroupGloo(
        dist.PrefixStore(prefix, store), me, len(ranks), timedelta(seconds=max(timeout_s, 1.0))
    )


def register_wait(tensor: torch.Tensor, on_wait) -> None:
    """Make ``wait_tensor(tensor)`` call ``on_wait()`` (which blocks until the tensor is ready,
    and raises if it never will be), the way the functional collectives register their work.

    Private: ``_register_work`` with a ``PythonCallbackWork`` (2.13, 2.14), else a work made from
    a torch future completed by running ``on_wait`` on a helper thread (2.11, 2.12).
    """
    c10d = torch._C._distributed_c10d
    callback_work = getattr(c10d, "PythonCallbackWork", None)
    if callback_work is not None:

        def wait(timeout) -> bool:
            on_wait()
            return True

        c10d._register_work(tensor, callback_work(wait))
        return
    import threading

    done = torch.futures.Future()

    def run() -> None:
        try:
            on_wait()
            done.set_result([tensor])
        except BaseException as error:  # noqa: BLE001 - delivered to the waiter
            done.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    c10d._register_work(tensor, c10d._create_work_from_future(done))


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group of a name found in a graph. Private (``_resolve_process_group``) with no
    public equivalent; the functional collectives use it themselves. Checked 2.11-2.14."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def _group_or_none(group_name: str) -> dist.ProcessGroup | None:
    """The process group a graph names; None when the name resolves to no group of this process
    (a graph read offline)."""
    try:
        return resolve_group(group_name)
    except (KeyError, RuntimeError, ValueError):
        return None


def backend_of(group_name: str) -> str:
    """The backend of the process group a graph names ("gloo", "nccl", "fake"...), "" for none."""
    group = _group_or_none(group_name)
    return "" if group is None else str(dist.get_backend(group)).lower()


def group_rank(group_name: str) -> int | None:
    """This process's rank in the process group a graph names; None for none."""
    group = _group_or_none(group_name)
    return None if group is None else group.rank()


def default_store() -> dist.Store | None:
    """The store the default process group was created with (None if unavailable).

    Private (``_get_default_store``); the public alternative is keeping the store you created,
    which a library cannot. Checked 2.11-2.14.
    """
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, ValueError):
        return None
