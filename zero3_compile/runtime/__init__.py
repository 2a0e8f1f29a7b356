"""What runs around the collectives: the cross-rank check (``guard.py``), each sharded model's
runtime (``root.py``), the gated calls of compiled graphs (``gate.py``), the eager write-through
of gathered parameters (``write_through.py``) and the optimizer hooks (``optimizers.py``)."""
