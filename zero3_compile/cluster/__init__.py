"""Agreement between ranks: every rank goes on, or every rank raises the same error naming the
rank(s) that failed and each one's reason.

One contract, ``Failure`` records turned into one error (``RankFailedError``, or the caller's own
type built from the records), met in one of two ways:

- ``agree`` / ``attempt``: a collective (one small all-gather over a group, or over each
  dimension of a mesh in turn) where every rank reaches the same call with its outcome;
  ``same`` is its variant for "every rank holds the same value" (a digest of a model's tensors).
- ``Meeting``: named points in the rendezvous store, for steps where a rank may fail anywhere
  in between (it posts its failure from an ``except`` handler and leaves) and a rank that never
  arrives must be named after a timeout.

After a collective failed (a peer died), ``lost_ranks`` names the ranks that do not answer a
``roll_call`` in the store.

The package imports only ``torch.distributed`` (and ``_torch.c10d`` for the default store): every
layer above may use it.
"""

from .agree import agree, attempt, same
from .failures import Failure, RankFailedError
from .meeting import Meeting
from .presence import lost_ranks, roll_call

__all__ = [
    "Failure",
    "Meeting",
    "RankFailedError",
    "agree",
    "attempt",
    "lost_ranks",
    "roll_call",
    "same",
]
