"""Getting parameters in and out: sharded checkpoints (``checkpoint/``), full state dicts
(``state_dict.py``) and initialising models built on ``meta`` (``materialize.py``)."""
