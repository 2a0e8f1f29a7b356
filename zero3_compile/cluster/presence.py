"""Which ranks are still there after a collective failed: a roll call in the rendezvous store."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch.distributed as dist

from .._torch.c10d import default_store


def roll_call(
    prefix: str, ranks: Iterable[int], wait_s: float, store: dist.Store | None = None
) -> set[int] | None:
    """This rank answers under ``prefix`` in ``store`` (default: the default process group's),
    then waits up to ``wait_s`` for ``ranks`` to answer; returns those that did, or None when the
    store cannot be reached (its host died). Used after a failed exchange to name the ranks that
    are gone.

    Example:
        ```python
        alive = roll_call("myjob/step-7/", range(dist.get_world_size()), wait_s=2.0)
        ```
    """
    store = store if store is not None else default_store()
    ranks = list(ranks)
    if store is None:
        return set(ranks)
    try:
        store.set(prefix + str(dist.get_rank()), "1")
        deadline = time.monotonic() + wait_s
        while True:
            alive = {r for r in ranks if store.check([prefix + str(r)])}
            if len(alive) == len(ranks) or time.monotonic() >= deadline:
                return alive
            time.sleep(0.05)
    except Exception:  # noqa: BLE001
        return None


def lost_ranks(
    prefix: str, ranks: Iterable[int], wait_s: float, store: dist.Store | None = None
) -> list[int]:
    """The ranks of ``ranks`` other than this one that do not answer a ``roll_call`` under
    ``prefix`` within ``wait_s`` (every survivor of a failed collective calls it at about the
    same time, so the living answer at once); [] when all answer. When the store itself is gone,
    its host is named: rank 0 (unless torchrun's agent hosts the store).

    Example:
        ```python
        except Exception:
            lost = lost_ranks("zero3/myjob/save3/rollcall/", range(world), wait_s=2.0)
        ```
    """
    me, ranks = dist.get_rank(), list(ranks)
    alive = roll_call(prefix, ranks, wait_s, store)
    if alive is None:
        return [0] if me != 0 and 0 in ranks else []
    return sorted(set(ranks) - alive - {me})
