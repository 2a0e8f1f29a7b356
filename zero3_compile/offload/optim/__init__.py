"""The optimizer offload: an optimizer's state in an offload store between steps, streamed
through ``step()`` in tiles, or stepped while the backward runs.

```python
opt = z3.offload_optimizer(torch.optim.AdamW(model.parameters()), tier="disk", path="/nvme/run1")
```
``api.py`` (``offload_optimizer``: the optimizer object, its ``step`` and state dicts routed
through the offload), ``tiled.py`` (``OptimizerOffload``: the state in its store; a step's tiles
read ahead and written behind), ``tiles.py`` (what a stepping pass is made of, shared by both
ways of stepping), ``in_backward.py`` (``in_backward=True``: each parameter steps as soon as its
gradient is reduced). It sits over the offload foundation (``..store``, ``..params``,
``..grads``...), which never imports it (tests/unit/test_layers.py).
"""

from .api import offload_optimizer

__all__ = ["offload_optimizer"]
