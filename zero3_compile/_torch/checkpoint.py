"""``torch.distributed.checkpoint`` internals."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_optimizer_state_init(active: bool = True) -> Iterator[None]:
    """Within the block, torch's ``get_state_dict`` / ``set_state_dict`` leave an optimizer
    without state as it is.

    They create the state of an optimizer that has none by stepping it once with zero gradients
    and lr 0 (private ``_init_optim_state`` of ``torch/distributed/checkpoint/state_dict.py``,
    torch 2.4 to 2.14): Adam's step count is then 1 before the first real step and every later
    update differs. Process-wide while the block runs; a no-op on a torch without the function
    (which creates no state either)."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    original = getattr(torch_state_dict, "_init_optim_state", None)
    if not active or original is None:
        yield
        return
    torch_state_dict._init_optim_state = lambda optim: None
    try:
        yield
    finally:
        torch_state_dict._init_optim_state = original


def metadata_path(reader, rank: int | None = None):
    """The path of a ``FileSystemReader``'s ``.metadata`` file (``__{rank}.metadata`` for a
    rank's own), as its ``read_metadata`` opens it (private ``_get_metadata_path``; no public
    alternative), checked 2.13-2.14."""
    return reader._get_metadata_path(rank)
