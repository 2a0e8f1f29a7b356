"""zero3 composed with model parallelism: ``zero3_compile.parallel``.

Tensor parallelism needs nothing from here: ``parallelize_module`` first, then ``z3.shard(model,
mesh=mesh["dp"])`` ([Note: zero3 over tensor parallelism] in ``sharding/layout.py``). Pipeline
parallelism: ``PipelineStage``, torch's stage for a zero3-sharded stage module (torch's own
stage recognises only FSDP2 and DDP modules).
"""

from .pipelining import PipelineStage

__all__ = ["PipelineStage"]
