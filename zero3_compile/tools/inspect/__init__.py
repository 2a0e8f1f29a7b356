"""See what the compiler did: per-graph reports, pictures, a command line.

report = zero3_compile.explain(model, example_input)      # compiles, does not train
print(report)                                             # a readable table per graph
report.save("zero3_report")                               # report.txt, .json, pictures

python -m zero3_compile.inspect train.py --world 2        # run a script, report its graphs
"""

from ...compiler import recording as _recording
from .explain import ExplainReport, explain
from .measure import measure_peak_bytes
from .report import GatherInfo, GraphReport, ReduceInfo, build_report
from .session import install_from_env as _install_from_env

# the compiler calls back into the tools, never imports them
_recording.on_compile(_install_from_env)
_recording.set_reporter(lambda record: build_report(record).to_json())

__all__ = [
    "ExplainReport",
    "GatherInfo",
    "GraphReport",
    "ReduceInfo",
    "build_report",
    "explain",
    "measure_peak_bytes",
]
