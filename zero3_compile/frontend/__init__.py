"""What the user touches: ``shard()`` (``shard.py``), the generated module classes
(``classes.py``, ``module.py``: ``Zero3Module``), assignment after sharding, pickling, recurrent
modules, leaf modules, mixed precision and gradient accumulation."""

# the modules that give the generated classes their methods (``classes.register_methods``)
from . import apply, assignment, pickling, rnn  # noqa: F401
