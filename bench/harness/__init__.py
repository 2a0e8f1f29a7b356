"""What the benchmark scripts share: launching ranks, the contenders, measuring, reporting.

- ``launch``: a function on N ranks in fresh processes, one log per rank (``run_ranks``).
- ``orchestrate``, ``runner``, ``contenders``: one contender's run (compare.py's systems).
- ``models``: presets, the Llama-style model, data, loss.
- ``memory``, ``comm``: memory and collective accounting from tensors and the profiler.
- ``proc``: the process's /proc counters and the phase recorder of the big-model runs.
- ``disk``: the disk's own bandwidth, page-cache drops, the offload stores' I/O trace.
- ``llama``: Hugging Face Llama shapes and the random-init checkpoints written for them.
- ``big_contenders``, ``big_report``: big_model.py's zero3, FSDP2 and DeepSpeed runs, its report.
- ``paths``: where results go (outside the tree).
- ``report``: summaries, markdown tables, JSON, charts.
"""
