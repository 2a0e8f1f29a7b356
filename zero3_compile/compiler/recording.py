"""Access to what the backend compiled: the scheduled graphs and Inductor's generated code.

```python
with zero3_compile.record_graphs() as records:
    loss_fn(compiled(x)).backward()
for record in records:          # one GraphRecord per compiled forward / backward graph
    print(record.kind, record.gm.code, record.source_code)
```
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch.fx as fx

from .graph_utils import output_node
from .node_keys import NUM_USER_OUTPUTS


@dataclass
class GraphRecord:
    """One graph the backend compiled, as handed to codegen (after every pass)."""

    kind: str  # "forward", "backward" or "inference"
    graph_id: str  # "<backend call>.<graph>", unique in the process
    gm: fx.GraphModule
    source_code: str | None = None  # Inductor's generated wrapper code (codegen="inductor")
    budget: object = None  # planner.BudgetPlan, on a forward graph compiled with a memory budget

    @property
    def saved(self) -> list[fx.Node]:
        """Forward graph outputs saved for backward (empty for other graphs)."""
        count = self.gm.meta.get(NUM_USER_OUTPUTS)
        if self.kind != "forward" or count is None:
            return []
        outputs = output_node(self.gm.graph).args[0]
        return [n for n in outputs[count:] if isinstance(n, fx.Node)]


class Recorder:
    """Receives every GraphRecord compiled while it is listening."""

    def __init__(self) -> None:
        self.records: list[GraphRecord] = []

    def add(self, record: GraphRecord) -> None:
        self.records.append(record)


_listening: list[Recorder] = []
_compile_seconds: dict[str, float] = {}
# Plug-ins of the tools (``tools/inspect``), which the compiler never imports: called at the
# start of every backend call, and to render a scheduled graph's report for ``dump_dir``.
_on_compile: list = []
_reporters: list = []


def on_compile(callback) -> None:
    """``callback()`` runs at the start of every backend call (the inspection CLI's recorder)."""
    if callback not in _on_compile:
        _on_compile.append(callback)


def compiling() -> None:
    for callback in list(_on_compile):
        callback()


def set_reporter(render) -> None:
    """``render(record) -> str``: the JSON report ``dump_dir`` writes for each scheduled graph."""
    _reporters[:] = [render]


def report_json(record: GraphRecord) -> str | None:
    return _reporters[0](record) if _reporters else None


def add_compile_time(phase: str, seconds: float) -> None:
    _compile_seconds[phase] = _compile_seconds.get(phase, 0.0) + seconds


@contextlib.contextmanager
def timed(phase: str) -> Iterator[None]:
    """Add the seconds the ``with`` block takes to ``phase`` (``compile_stats``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add_compile_time(phase, time.perf_counter() - start)


def compile_stats() -> dict[str, float]:
    """Seconds this process spent in each phase of the backend's compiles (ours and Inductor's
    work on the scheduled graphs), for ``bench/compile_time.py``."""
    return dict(_compile_seconds)


def listen(recorder: Recorder) -> None:
    _listening.append(recorder)


def stop_listening(recorder: Recorder) -> None:
    if recorder in _listening:
        _listening.remove(recorder)


def listening() -> list[Recorder]:
    """The recorders listening now (a backend call keeps the ones active when it started)."""
    return list(_listening)


@contextlib.contextmanager
def record_graphs() -> Iterator[list[GraphRecord]]:
    """Collect a ``GraphRecord`` for every graph compiled inside the ``with`` block.

    Example:
        ```python
        with z3.record_graphs() as records:
            loss_fn(step_model(x)).backward()
        for record in records:
            print(record.kind, record.gm.code)  # the scheduled graph, after every pass
        ```
    """
    recorder = Recorder()
    listen(recorder)
    try:
        yield recorder.records
    finally:
        stop_listening(recorder)
