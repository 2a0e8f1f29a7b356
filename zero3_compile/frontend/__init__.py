"""What the user touches: ``shard()`` (``shard.py``), the generated module classes
(``classes.py``, ``module.py``: ``Zero3Module``), assignment after sharding, pickling, recurrent
modules, leaf modules, mixed precision and gradient accumulation."""
