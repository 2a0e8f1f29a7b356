"""What a stepping pass of the optimizer offload is made of, for ``step()`` (``tiled.py``) and
for the steps taken during the backward (``in_backward.py``) alike: the optimizers that may step
a parameter in pieces, a piece, the feed that hands a pass its tiles in order, the record that
undoes a pass.

A tile is a list of whole parameters stepped together, or a one-element list of a ``Piece``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..._torch.dtensor import local_tensor

# optimizers whose update of an element reads only that element's gradient and state (and
# per-parameter scalars): a parameter can step in pieces with the same result
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
PIECE_ALIGN = 4096  # elements: a piece of any dtype starts at a 4096-byte boundary (O_DIRECT)


@dataclass(eq=False)
class Piece:
    """Elements ``start .. stop`` of one parameter's flattened shard, stepped on their own."""

    param: torch.Tensor
    start: int
    stop: int
    last: bool
    slot: int = 0  # of the step's staging pool
    given: torch.Tensor | None = None  # the gradient shard, handed over by the backward
    values: torch.Tensor | None = None  # the whole shard as the backward's reload read it
    # (read only: the backward's collective may read it too)
    # read by the load: the piece's shard, gradient and state values (the step writes the
    # shard's in place); the state the step made, for the write
    shard: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)


class Feed:
    """The tiles of one stepping pass, in order: all known when ``step()`` starts, or appended
    as the backward produces gradients (``in_backward``) until ``close()``. A piece's staging
    slot follows its position, so the tiles in memory together never share one."""

    def __init__(self, slots: int, tiles: list | None = None):
        self.slots = slots
        self.tiles: list[list] = []
        self.closed = False
        self.cond = threading.Condition()
        if tiles is not None:
            self.append(tiles)
            self.close()

    def append(self, tiles: list[list]) -> None:
        with self.cond:
            for tile in tiles:
                if isinstance(tile[0], Piece):
                    tile[0].slot = len(self.tiles) % self.slots
                self.tiles.append(tile)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def peek(self, i: int) -> list | None:
        with self.cond:
            return self.tiles[i] if i < len(self.tiles) else None

    def get(self, i: int) -> list | None:
        """Tile ``i``, once it is there; None when the feed closed before it."""
        with self.cond:
            while i >= len(self.tiles) and not self.closed:
                self.cond.wait()
            return self.tiles[i] if i < len(self.tiles) else None

    def stepped(self, tile: list) -> None:
        """Tile ``tile`` stepped: what it held for the pass can go."""


class Undo:
    """What undoing a pass over ``params`` needs: the small per-parameter values (step
    counters) as they were, and which parameters had no state before."""

    def __init__(self, optimizer, params: list):
        self.params: list = []
        self.scalars: dict = {}
        self.fresh: list = []
        self.add(optimizer, params)

    def add(self, optimizer, params: list) -> None:
        self.params.extend(params)
        for param in params:
            state = optimizer.state.get(param, {})
            if not state:
                self.fresh.append(param)
            for key, value in state.items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    copy = value.clone() if isinstance(value, torch.Tensor) else value
                    self.scalars[(param, key)] = copy


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (what the store holds), outside autograd."""
    if isinstance(tensor, DTensor):
        return local_tensor(tensor).detach()
    return tensor.detach()
