"""``zero3_compile.estimate``: the memory estimates (``zero3_compile/tools/estimate``), under the
name the command line uses."""

from ..tools.estimate import *  # noqa: F401,F403
from ..tools.estimate import estimate_memory, main  # noqa: F401
