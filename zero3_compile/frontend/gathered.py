"""``z3.gathered(model_or_params, modifier_rank=None)``: parameters gathered once, for inference
(``generate``) or to change them as whole tensors.

```python
with z3.gathered(model):
    tokens = model.generate(**inputs, max_new_tokens=64)   # no collective per token

with z3.gathered(model.lm_head.parameters(), modifier_rank=0):
    if dist.get_rank() == 0:
        model.lm_head.weight.copy_(loaded)                 # rank 0's values reach every shard
```
Each parameter is all-gathered once on entry (in its compute dtype, in the order given: the same
collectives on every rank) and read from there until the block ends; then the full copies are
freed and the shards are what the model reads again. Inside the block the model runs no
collective, so ranks may run different prompts, of different lengths, for different numbers of
steps. The copies carry no gradient, so training inside the block fails at ``backward()``
instead of silently skipping the update. Memory: the gathered parameters per rank while the
block lasts.

Writes to the parameters inside the block (DeepSpeed's ``GatheredParameters`` semantics, never a
silent loss):

- ``modifier_rank=r`` (a global rank of the model's mesh): on exit rank ``r``'s full copies are
  broadcast and every rank keeps its rows of them; the other ranks' writes are discarded.
- ``modifier_rank=None``: a write every rank makes alike (``model.apply(init)`` with a common
  seed, ``weight.mul_(2)`` everywhere) reaches every shard; a write some ranks make and others
  do not, or that differs between ranks, raises ``RuntimeError`` on every rank on exit (the
  changes are discarded, the shards keep their values) naming ``modifier_rank``. The ranks compare
  what each changed with one all-reduce of a flag per parameter (and, for parameters every rank
  changed, one of a digest of the full copy).

A block that raises discards the changes and runs no collective on the way out. Blocks nest: an
inner block over parameters an outer one gathered reads the outer's copies (and with
``modifier_rank`` hands rank ``r``'s values to every rank on its own exit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch.tensors import version
from ..collectives.ops import UNSHARD
from ..runtime.write_through import whole_parameter
from ..sharding.state import ShardedParam, ShardState, state_of
from .broadcast import all_reduce_mesh, broadcast_from, mesh_device, source_rank
from .loading import sharded_states

# id(full copy) -> its parameter's state, while a block holds it (a parameter read inside an
# outer block and handed to an inner one is the outer block's copy)
_copies: dict[int, ShardedParam] = {}
# id(state) -> its copy's fingerprint when every rank last agreed on it (the gather, or an
# inner block's modifier_rank exit)
_agreed: dict[int, tuple[int, int]] = {}


@contextlib.contextmanager
def gathered(
    model_or_params: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    *,
    modifier_rank: int | None = None,
) -> Iterator[nn.Module | list[torch.Tensor]]:
    """Gather the sharded parameters of a module (or the given parameters) once; restore the
    shards on exit. Every rank of the model's mesh must enter it (the gathers and the exit's
    checks are collective); inside, none has to run anything collectively.

    model_or_params: a module (every sharded parameter in it), one parameter, or an iterable of
        them (``module.parameters()``, ``[layer.weight]``); tensors that are no sharded
        parameter are ignored, as DeepSpeed's ``GatheredParameters`` ignores them.
    modifier_rank: None (writes must be the same on every rank, else an error on exit), or the
        global rank whose writes every rank keeps (see the module docstring).

    Yields the module, or for parameters the list of their full copies (in the order given).

    Example:
        ```python
        with z3.gathered(model):  # one all-gather per parameter, none per token
            tokens = model.generate(**inputs, max_new_tokens=64)

        with z3.gathered(model.lm_head.parameters(), modifier_rank=0):
            if dist.get_rank() == 0:
                model.lm_head.weight.copy_(pretrained)  # every rank keeps rank 0's values
        ```
    """
    states = _states(model_or_params)
    roots = _check_modifier(states, modifier_rank)
    owned, borrowed = [], []
    for state in states:
        if state.state is ShardState.GATHERED:
            borrowed.append(state)  # an enclosing block's copy
        elif state.state is ShardState.SHARDED:
            owned.append(state)
        else:
            raise RuntimeError(
                f"zero3: z3.gathered() needs every parameter sharded; {state.fqn!r} is "
                f"{state.state.name} (turn gradient sync back on first)"
            )
    done = []
    try:
        with torch.no_grad():
            for state in owned:
                with state.root.active():
                    full = UNSHARD(state.local(), state.param_id, state.spec.literal(), None)
                state.kept_full = full
                state.transition(ShardState.GATHERED)
                _copies[id(full)] = state
                _agreed[id(state)] = _fingerprint(full)
                done.append(state)
        yield (
            model_or_params
            if isinstance(model_or_params, nn.Module)
            else [s.kept_full for s in states]
        )
    except BaseException:
        _release(done)  # discarded; no collective on the way out of a failure
        raise
    try:
        if modifier_rank is not None:
            _take_modifiers_values(roots, owned + borrowed, modifier_rank)
        else:
            _check_same_writes(roots, done)
        for state in done if modifier_rank is None else owned + borrowed:
            _write_back_if_changed(state)
        if modifier_rank is not None:
            for state in borrowed:  # the enclosing block's copies agree again
                _agreed[id(state)] = _fingerprint(state.kept_full)
    finally:
        _release(done)


def _states(model_or_params) -> list[ShardedParam]:
    if isinstance(model_or_params, nn.Module):
        return sharded_states(model_or_params)
    if isinstance(model_or_params, torch.Tensor):
        model_or_params = [model_or_params]
    found: dict[int, ShardedParam] = {}
    for value in model_or_params:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"zero3: z3.gathered() takes a module, a parameter or an iterable of parameters, "
                f"got an iterable holding {type(value).__name__}"
            )
        sharded = whole_parameter(value)
        state = state_of(sharded if sharded is not None else value) or _copies.get(id(value))
        if state is not None:
            found.setdefault(id(state), state)
    return list(found.values())


def _check_modifier(states: list[ShardedParam], modifier_rank) -> dict:
    """The runtimes of ``states`` (in order of first use), each with its states; checks that
    ``modifier_rank`` is a rank of each of their meshes."""
    roots: dict[int, tuple] = {}
    for state in states:
        roots.setdefault(id(state.root), (state.root, []))[1].append(state)
    if modifier_rank is not None:
        for root, _ in roots.values():
            source_rank(root.dp, modifier_rank)
    return roots


def _release(done: list[ShardedParam]) -> None:
    for state in done:
        _copies.pop(id(state.kept_full), None)
        _agreed.pop(id(state), None)
        state.kept_full = None
        state.transition(ShardState.SHARDED)


def _take_modifiers_values(roots: dict, states: list[ShardedParam], modifier_rank: int) -> None:
    """Every rank's full copies become ``modifier_rank``'s."""
    wanted = {id(s) for s in states}
    for root, members in roots.values():
        copies = [s.kept_full for s in members if id(s) in wanted]
        broadcast_from(copies, root.dp, modifier_rank)


def _fingerprint(full: torch.Tensor) -> tuple[int, int]:
    """What an in-place write (directly or through a view) or a ``.data`` swap changes."""
    return version(full), full.data_ptr()


def _check_same_writes(roots: dict, done: list[ShardedParam]) -> None:
    """Raise on every rank unless every rank changed the same copies to the same values."""
    owned = {id(s) for s in done}
    problems = []
    for root, members in roots.values():
        members = [s for s in members if id(s) in owned]
        if not members:
            continue
        world = root.dp.shard_size * root.dp.replicate_size
        touched = [_touched(s) for s in members]
        counts = torch.tensor(touched, dtype=torch.int64, device=mesh_device(root.dp))
        all_reduce_mesh(counts, root.dp)
        counts = counts.tolist()
        problems += [
            f"{s.fqn!r} (changed on {n} of {world} ranks)"
            for s, n in zip(members, counts)
            if 0 < n < world
        ]
        everywhere = [s for s, n in zip(members, counts) if n == world]
        if everywhere:
            digests = torch.stack([_digest(s.kept_full) for s in everywhere]).to(
                mesh_device(root.dp)
            )
            bounds = torch.cat([digests, -digests])
            all_reduce_mesh(bounds, root.dp, dist.ReduceOp.MAX)
            high, low = bounds[: len(everywhere)], -bounds[len(everywhere) :]
            problems += [
                f"{s.fqn!r} (changed differently on the ranks)"
                for s, same in zip(everywhere, (high == low).all(dim=1).tolist())
                if not same
            ]
    if problems:
        raise RuntimeError(
            f"zero3: parameters written inside z3.gathered(..., modifier_rank=None) differ "
            f"between ranks: {', '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}; "
            "the changes were discarded (the shards keep their values). Pass modifier_rank=r "
            "to keep rank r's values on every rank (DeepSpeed's GatheredParameters(..., "
            "modifier_rank=r)), or make the same change on every rank"
        )


def _touched(state: ShardedParam) -> bool:
    return _fingerprint(state.kept_full) != _agreed[id(state)] or not _rows_equal(state)


_DIGEST_CHUNK = 1 << 22  # elements digested at a time


def _digest(full: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the copy's bits (plain and position-weighted, wrapping): equal copies
    give equal digests; a changed copy almost surely another."""
    flat = full.detach().contiguous().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    bits = (
        flat.view(ints[flat.element_size()])
        if flat.element_size() in ints
        else flat.view(torch.uint8)
    )
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        part = bits[start : start + _DIGEST_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1
        total[0] += part.sum()
        total[1] += (part * weights).sum()
    return total


def _rows_equal(state: ShardedParam) -> bool:
    from ..offload.params import loaded

    rows = state.spec.local_view(state.kept_full, state.rank)
    with loaded([state] if state.offload is not None else [], write_back=False):
        return torch.equal(rows, state.local().to(rows.dtype))


@torch.no_grad()
def _write_back_if_changed(state: ShardedParam) -> None:
    """This rank's rows of the full copy into the shard, if they differ from it."""
    from ..offload.params import loaded

    if _rows_equal(state):
        return
    rows = state.spec.local_view(state.kept_full, state.rank)
    with loaded([state] if state.offload is not None else [], write_back=True):
        state.local().copy_(rows.to(state.local().dtype))
