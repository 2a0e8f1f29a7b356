"""Weights out to a rollout engine: ``from zero3_compile import rollout``.

```python
from zero3_compile.rollout import iter_full_parameters

for name, tensor in iter_full_parameters(model, dtype=torch.bfloat16):  # every rank, in step
    engine.load_weights([(name, tensor)])
```
A generator of ``(Hugging Face name, full tensor)`` that gathers one tensor (or one bucket of
``bucket_mb``) at a time, so no rank holds more than its shards plus what is being handed out;
peft models export merged LoRA weights (or the adapter alone, or the base alone). See
``export.py``; ``plan.py`` decides the names, ``adapters.py`` the peft cases, ``gather.py`` the
collectives. Integrations (verl's ``get_per_tensor_param``, TRL's vLLM sync, ``z3hf`` merged
exports) build on it.
"""

from .export import iter_full_parameters

__all__ = ["iter_full_parameters"]
