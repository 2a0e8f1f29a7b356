"""Pictures of a scheduled graph: communication lanes against compute, and memory over time.

matplotlib is optional (``pip install zero3_compile[plot]``); without it nothing is drawn.
"""

from __future__ import annotations

import logging

from .report import GraphReport

log = logging.getLogger(__name__)


def plot_graph(report: GraphReport, path: str) -> bool:
    """Draw the schedule and memory of one graph into ``path`` (PNG or SVG); False if no matplotlib.

    The x axis is the position in the scheduled graph (program order). Compute nodes are ticks on
    the compute lane; each all-gather / reduce-scatter is a bar from issue to wait on its lane, so
    a bar spanning compute ticks is communication that overlaps compute. Arrows go from each
    gather's wait to the first node using the gathered parameters. Below: bytes alive over time.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("zero3: matplotlib is not installed; no picture for %s", path)
        return False

    fig, (lanes, memory) = plt.subplots(
        2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    compute = [i for i, kind in enumerate(report.node_kinds) if kind == "compute"]
    lanes.vlines(compute, 2.6, 3.4, color="0.35", linewidth=0.6)
    for g in report.gathers:
        lanes.barh(2, g.wait - g.issue, left=g.issue, height=0.6, color="tab:blue", alpha=0.75)
        lanes.annotate(
            "",
            xy=(g.first_use, 2.6),
            xytext=(g.wait, 2.3),
            arrowprops=dict(arrowstyle="->", color="tab:blue", lw=0.8),
        )
        lanes.text(g.issue, 1.6, str(g.bucket), fontsize=6, color="tab:blue")
    for r in report.reductions:
        lanes.barh(1, r.wait - r.issue, left=r.issue, height=0.6, color="tab:orange", alpha=0.75)
    for r in report.reloads:
        lanes.barh(0, r.wait - r.issue, left=r.issue, height=0.6, color="tab:purple", alpha=0.6)
    lanes.set_yticks([0, 1, 2, 3], ["reload", "reduce-scatter", "all-gather", "compute"])
    lanes.set_ylim(-0.6, 3.6)
    lanes.set_title(
        f"{report.kind} graph {report.graph_id}: {len(report.gathers)} all-gathers, "
        f"{len(report.reductions)} reduce-scatters (bars: issue to wait)"
    )
    mib = [b / 2**20 for b in report.memory]
    memory.plot(range(len(mib)), mib, color="tab:green")
    memory.fill_between(range(len(mib)), mib, color="tab:green", alpha=0.2)
    memory.set_ylabel("MiB alive")
    memory.set_xlabel("position in the scheduled graph")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
