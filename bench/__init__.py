"""Benchmarks of zero3_compile against FSDP2, DeepSpeed ZeRO-3 and DDP (scripts, not a package API)."""
