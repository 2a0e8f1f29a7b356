"""Offload: parameter shards and optimizer state in host memory or on disk between uses.

```python
model = z3.shard(model, offload=z3.Offload(params="disk", path="/nvme/run1"))   # or "cpu", None
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), tier="disk", path="/nvme/run1")
z3.offload_states(model, opt)   # on demand: everything still in memory, until reload_states
```
See ``params.py`` (parameter shards, reloaded by graph nodes ahead of their all-gathers),
``optimizer.py`` (optimizer state streamed in tiles through ``step()``), ``store.py`` (the
tiers), ``on_demand.py`` (``offload_states`` / ``reload_states`` between an RLHF loop's phases),
``access.py`` (offloaded values read and written through the DTensor API) and
``zero3_compile.estimate`` (what stays resident).
"""

from .on_demand import offload_states, reload_states
from .optimizer import offload_optimizer
from .params import Offload
from .store import OffloadError

__all__ = ["Offload", "OffloadError", "offload_optimizer", "offload_states", "reload_states"]
