"""``zero3_compile.inspect``: the inspection tools (``zero3_compile/tools/inspect``), under the
name the command line and earlier releases use."""

from ..tools.inspect import *  # noqa: F401,F403
from ..tools.inspect import __all__  # noqa: F401
