"""Benchmarks of zero3_compile against FSDP2, DeepSpeed ZeRO-3 and DDP: scripts run as
``python -m bench.<script>`` from the repository root, sharing ``bench.harness`` (not a package
API)."""
