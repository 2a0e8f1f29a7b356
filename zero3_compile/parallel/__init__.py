"""zero3 composed with model parallelism: ``zero3_compile.parallel``.

Tensor parallelism needs nothing from here: ``parallelize_module`` first, then ``z3.shard(model,
mesh=mesh["dp"])`` ([Note: zero3 over tensor parallelism] in ``sharding/layout.py``). Pipeline
parallelism: ``PipelineStage``, torch's stage for a zero3-sharded stage module (torch's own
stage recognises only FSDP2 and DDP modules), and ``clip_grad_norm_``, which clips by the norm
of all stages' gradients.
"""

from .clipping import clip_grad_norm_
from .pipelining import PipelineStage

__all__ = ["PipelineStage", "clip_grad_norm_"]
