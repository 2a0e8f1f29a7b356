"""Where the repository's folders are, for tests that run its scripts and read its files."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "zero3_compile")
EXAMPLES = os.path.join(ROOT, "examples")
BENCH = os.path.join(ROOT, "bench")
