"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, sealed saves; verified,
safe loads.

``save_checkpoint(path, model, optimizer)`` writes every rank's shards of the model and optimizer
state (keys are parameter names, as ``get_state_dict`` gives them) into a fresh directory
``path.tmp-<save id>``. Each rank then fsyncs and records the size and sha256 of every file it
wrote there (its ``__<rank>_*.distcp`` shards, hashed as the writer wrote them; its ``rank_state``
file; rank 0 also DCP's ``.metadata``, those two read back), rank 0 merges the records into
``zero3_manifest.json`` (with the save id and a checksum of the manifest itself), and only then
is the directory swapped in for ``path``: an interrupted save (a full disk, a killed rank) leaves
the previous checkpoint intact and loadable.

``load_checkpoint`` checks the checkpoint against the manifest: every file present with its size
first, then each file's sha256 as it reads it (a file up to ``READ_WHOLE_MAX`` read whole into
memory, hashed on the way, checked before DCP parses it; a larger one hashed on a thread while DCP
parses its items and checked when DCP closes it, a parse that failed on it reported as the
damage), and nothing becomes the model's until every rank read everything and every file it read
was intact: offloaded values are written to their stores' free slots, committed at the end
(``offload/incoming.py``); the values it loads into memory wait in buffers until then. A load
that cannot hold its in-memory values twice hashes every file first (the ranks share the hashing)
and reads them again to load them. Either way a missing, truncated or
modified file, or one copied in from another save, raises ``CheckpointCorruptError`` naming the
file on every rank, never a model with wrong values. A checkpoint without a manifest loads only
with ``verify=False``. It reads back at any world size (DCP reshards), and reads DCP's metadata
with an unpickler that accepts only checkpoint metadata classes, never arbitrary objects.

A save changes nothing in the training: torch's state-dict helpers would step an optimizer that
has no state yet (zero gradients, lr 0) to create it, which makes Adam's step count 1 before the
first real step; ``save_checkpoint`` keeps them from it, so the checkpoint of an optimizer that
has not stepped holds its parameter groups only, and ``load_checkpoint`` gives the optimizer no
state from it (as a fresh one). A save inside a gradient-sync-off window (``set_requires_gradient_
sync(model, False)``) writes the shards and the optimizer state of the last step; the gradients
pending for the next step stay with the training and are not part of the checkpoint (as in
DeepSpeed and torch's DCP, which save no gradients).

``rank_state`` carries what else a resumed job needs per rank (step, LR scheduler, RNG states, data
position; tensors, numbers, strings and containers of them): it is written into the same staging
directory, so it is sealed and swapped in together with the shards, and ``load_checkpoint`` returns
it (read with ``torch.load(weights_only=True)``).

Both calls are collective. When a rank dies during one, the others' next exchange fails (gloo
raises at once when the dead process's connections close; otherwise the process group's timeout
bounds the wait), and they raise ``PeerLostError`` naming the ranks that did not answer a roll
call in the store within ``ROLL_CALL_S`` seconds.

Where each part lives:

- ``api.py``: the four calls (``save_checkpoint``, ``load_checkpoint``, ``load_rank_state``,
  ``verify_checkpoint``), wiring the parts below;
- ``state.py``: the state dicts DCP saves and loads (read from the shards, offloaded values one
  at a time, no optimizer stepped to create its state);
- ``manifest.py``: the manifest, checking files against it, ``CheckpointCorruptError``;
- ``hashing.py``: sha256 of files as they are written and read back;
- ``durable.py``: fsync, the manifest written last, the swap-in (``seal``);
- ``metadata.py`` and ``reader.py``: DCP's metadata read safely; the reader that verifies each
  file as DCP reads it;
- ``peers.py``: ``PeerLostError``, from a roll call (``cluster.lost_ranks``).
"""

from __future__ import annotations

from .api import load_checkpoint, load_rank_state, save_checkpoint, verify_checkpoint
from .manifest import MANIFEST, CheckpointCorruptError
from .metadata import SafeFileSystemReader
from .peers import ROLL_CALL_S, PeerLostError

__all__ = [
    "MANIFEST",
    "ROLL_CALL_S",
    "CheckpointCorruptError",
    "PeerLostError",
    "SafeFileSystemReader",
    "load_checkpoint",
    "load_rank_state",
    "save_checkpoint",
    "verify_checkpoint",
]
