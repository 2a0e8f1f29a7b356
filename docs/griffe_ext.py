"""A griffe extension for the API reference: this project's docstrings describe parameters as
``name: text`` paragraphs with indented continuation lines, which Google-style parsing would
take for admonitions (``name`` as their kind, the name lost). Such a paragraph is rewritten
``**name**: text`` with its continuation joined, before mkdocstrings parses the docstring.
Section headers (``Example:``, ``Attributes:``, ... with nothing after the colon) are left alone.
"""

from __future__ import annotations

import re

import griffe

_PARAM = re.compile(r"^(?P<name>[A-Za-z_][\w]*(?:, [A-Za-z_][\w]*)*): (?P<text>\S.*)$")


def rewrite(doc: str) -> str:
    lines = doc.splitlines()
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else _PARAM.match(line)
        if match:
            names = ", ".join(f"`{n.strip()}`" for n in match.group("name").split(","))
            out.append(f"{names}: {match.group('text')}")
            i += 1
            while i < len(lines) and lines[i].startswith("    ") and lines[i].strip():
                out.append(lines[i].strip())
                i += 1
            out.append("")  # its own paragraph
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class ParamParagraphs(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
