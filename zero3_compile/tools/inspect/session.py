"""Record every graph a process compiles and write the reports when it exits.

Enabled by the environment variable ``ZERO3_INSPECT_DIR`` (set by ``python -m
zero3_compile.inspect``): each rank writes ``$ZERO3_INSPECT_DIR/rank<r>/``. The recorder and its
exit hook are installed when the backend first compiles, not at import.
"""

from __future__ import annotations

import atexit
import logging
import os

from ...compiler.recording import Recorder, listen

log = logging.getLogger(__name__)

ENV = "ZERO3_INSPECT_DIR"
_installed = False


def install_from_env() -> None:
    """Start recording for ``python -m zero3_compile.inspect`` (once per process)."""
    global _installed
    folder = os.environ.get(ENV)
    if _installed or not folder:
        return
    _installed = True
    recorder = Recorder()
    listen(recorder)

    def write() -> None:
        from .explain import ExplainReport
        from .report import build_report

        if not recorder.records:
            return
        rank = int(os.environ.get("RANK", "0"))
        target = os.path.join(folder, f"rank{rank}")
        try:
            ExplainReport([build_report(r) for r in recorder.records]).save(target)
        except Exception:  # never turn a finished training run into a failure
            log.exception("zero3: could not write the inspection report to %s", target)

    atexit.register(write)
