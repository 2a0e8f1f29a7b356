"""The frozen record of everything a pass may read: options, policies, which graph it is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .options import Options

GRAPH_KINDS = ("joint", "forward", "backward", "inference")


def block_of(name: str) -> str:
    """The repeated block a parameter belongs to: its name up to the first numeric component.

    ``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``; parameters outside any
    ``ModuleList``/``Sequential`` index (embeddings, final norm, head) belong to the root, "".
    Buckets never mix two different non-root blocks; root parameters join any bucket.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


@dataclass(frozen=True)
class Plan:
    options: Options = field(default_factory=Options)
    graph_kind: str = "forward"
    block_of: Callable[[str], str] = block_of

    def for_graph(self, graph_kind: str) -> Plan:
        if graph_kind not in GRAPH_KINDS:
            raise ValueError(f"zero3: unknown graph kind {graph_kind!r}")
        return replace(self, graph_kind=graph_kind)
