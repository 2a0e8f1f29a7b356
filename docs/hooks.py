"""MkDocs hooks: the reference tables generated from the code's one definition of each.

``<!-- generated: options -->`` in a page becomes the table of ``zero3_compile.Options`` (its
fields, types and defaults from the dataclass, the meaning of each from its docstring's
``Attributes:`` section); ``<!-- generated: deepspeed-keys -->`` the DeepSpeed config keys that
``zero3_compile.hf.translate_deepspeed_config`` understands and what each becomes (read from
``zero3_compile/hf/deepspeed_config.py``). Nothing here is written twice: change the code, the
page follows. ``tests/distributed/test_docs.py`` imports these functions too.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing


def _cell(text: str) -> str:
    """One table cell: no line breaks, pipes escaped, ``code`` kept as code."""
    text = " ".join(text.split())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return text.replace("|", "\\|")


def docstring_attributes(obj) -> dict[str, str]:
    """The ``Attributes:`` section of ``obj``'s (Google-style) docstring: name -> description."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    if "Attributes:" not in lines:
        return {}
    out: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^ {4}(\w+)(?: \([^)]*\))?: (.*)$", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2)
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def options_table() -> str:
    """Markdown table of every ``Options`` field: name, type, default, meaning."""
    from zero3_compile import Options

    meanings = docstring_attributes(Options)
    hints = typing.get_type_hints(Options)
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(Options):
        hint = str(hints[field.name]).replace("typing.", "").replace("<class '", "")
        hint = hint.replace("'>", "").replace("NoneType", "None")
        meaning = meanings.get(field.name)
        if meaning is None:
            raise ValueError(
                f"docs: Options.{field.name} has no entry in the Attributes: section of the "
                "Options docstring (zero3_compile/compiler/options.py)"
            )
        rows.append(
            f"| `{field.name}` | `{_cell(hint)}` | `{field.default!r}` | {_cell(meaning)} |"
        )
    return "\n".join(rows)


def deepspeed_keys_table() -> str:
    """Markdown table of the DeepSpeed config keys ``translate_deepspeed_config`` understands."""
    import importlib

    from zero3_compile.hf import deepspeed_config as ds

    try:  # the keys' own table (dotted key -> what it becomes), where the package has one
        keys = importlib.import_module("zero3_compile.hf.deepspeed_keys").KEYS
    except (ImportError, AttributeError):
        keys = getattr(ds, "KEYS", None)
    if keys:
        rows = ["| DeepSpeed key | in zero3_compile |", "|---|---|"]
        for key, what in keys.items():
            if isinstance(what, tuple):  # (status, why)
                what = ": ".join(str(part) for part in what)
            rows.append(f"| `{key}` | {_cell(str(what))} |")
        return "\n".join(rows)
    notes = {**getattr(ds, "_TOP_NOTES", {})}
    notes.update(
        {f"zero_optimization.{k}": v for k, v in getattr(ds, "_BY_CONSTRUCTION", {}).items()}
    )
    refused = {f"zero_optimization.{k}": v for k, v in getattr(ds, "_UNSUPPORTED", {}).items()}
    keys = sorted(getattr(ds, "_TOP_KEYS", ())) + sorted(
        f"zero_optimization.{k}" for k in getattr(ds, "_ZERO_KEYS", ())
    )
    rows = ["| DeepSpeed key | in zero3_compile |", "|---|---|"]
    for key in keys:
        if key in refused:
            what = f"refused unless off: {refused[key]}"
        elif key in notes:
            what = f"accepted with a note: {notes[key]}"
        else:
            what = "translated (see the sections below and `translate_deepspeed_config`)"
        rows.append(f"| `{key}` | {_cell(what)} |")
    return "\n".join(rows)


GENERATED = {"options": options_table, "deepspeed-keys": deepspeed_keys_table}


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' signature)
    for name, make in GENERATED.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
