"""Offload: parameter shards and optimizer state in host memory or on disk between uses.

```python
model = z3.shard(model, offload=z3.Offload(params="disk", path="/nvme/run1"))   # or "cpu", None
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), tier="disk", path="/nvme/run1")
z3.offload_states(model, opt)   # on demand: everything still in memory, until reload_states
```
The foundation: ``store.py`` (the tiers), ``params.py`` (parameter shards, reloaded by graph
nodes ahead of their all-gathers), ``grads.py`` (gradient shards spooled from the backward),
``model.py`` (a model's offload set up on every rank), ``on_demand.py`` (``offload_states`` /
``reload_states`` between an RLHF loop's phases), ``access.py`` (offloaded values read and
written through the DTensor API). Over it, the feature that uses it: ``optim/`` (optimizer state
streamed in tiles through ``step()``, or stepped during the backward); the foundation never
imports ``optim/``. ``zero3_compile.estimate`` says what stays resident.
"""

from .model import Offload
from .on_demand import offload_states, reload_states
from .optim import offload_optimizer
from .store import OffloadError

__all__ = ["Offload", "OffloadError", "offload_optimizer", "offload_states", "reload_states"]
