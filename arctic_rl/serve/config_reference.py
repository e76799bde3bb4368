"""The client config reference of docs/configuration.md, rendered from the config models (``config.py``): one
Markdown row per field (dotted name, type, default, description), sections recursively."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields, is_dataclass
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import annotated_types
from pydantic import BaseModel

from arctic_rl.serve.config import ArcticRLClientConfig


def config_reference_markdown() -> str:
    """A Markdown table of every field (dotted name, type, default, description) in declaration order,
    each section's row before its fields. The README's config reference is this output, so it depends on
    the models only (not on the environment)."""
    rows = ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | {cell} |" for name, cell in _reference_rows(ArcticRLClientConfig, "")]
    return "\n".join(rows) + "\n"


def _reference_rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str]]:
    """``(dotted name, "type | default | description")`` of ``model``'s fields, sections recursively (a section
    that is an option dataclass of ``modules/options.py``: its fields, each described by the class's docstring)."""
    rows = []
    for name, info in model.model_fields.items():
        section = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) else None
        options = info.annotation if is_dataclass(info.annotation) else None
        if section is not None or options is not None:
            default = "section"
        elif info.is_required():
            default = "required"
        else:
            default = f"`{json.dumps(info.get_default(call_default_factory=True))}`"
        kind = f"`{_type_text(info.annotation)}`" + "".join(f", {bound}" for bound in _bounds_text(info.metadata))
        rows.append((prefix + name, " | ".join(cell.replace("|", "\\|") for cell in (kind, default, info.description or ""))))
        if section is not None:
            rows += _reference_rows(section, f"{prefix}{name}.")
        if options is not None:
            rows += _option_rows(options, f"{prefix}{name}.")
    return rows


def _option_rows(cls: type, prefix: str) -> list[tuple[str, str]]:
    """``(dotted name, "type | default | description")`` of an option dataclass's fields, described by its docstring's ``Args``."""
    hints, docs, default = get_type_hints(cls), _arg_docs(cls.__doc__ or ""), cls()
    rows = []
    for f in fields(cls):
        cells = (f"`{_type_text(hints[f.name])}`", f"`{json.dumps(getattr(default, f.name))}`", docs.get(f.name, ""))
        rows.append((prefix + f.name, " | ".join(cell.replace("|", "\\|") for cell in cells)))
    return rows


def _arg_docs(doc: str) -> dict[str, str]:
    """``{name: its description, one line}`` of a Google-style docstring's ``Args:`` section."""
    docs: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Args:") + 1 if "Args:" in lines else len(lines)
    name = None
    for line in lines[start:]:
        if not line.strip():
            break
        head, sep, text = line.strip().partition(": ")
        if line.startswith("    ") and not line.startswith("        ") and sep and head.isidentifier():
            name, docs[head] = head, text.strip()
        elif name is not None:
            docs[name] += " " + line.strip()
    return docs


def _type_text(annotation: Any) -> str:
    """``str | None``, ``"local" | "http"``, ``dict[str, Any]``: a type as a config file sees it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, UnionType):
        return " | ".join(_type_text(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    return annotation.__name__


def _bounds_text(metadata: list[Any]) -> list[str]:
    """``>= 1``, ``> 0``, ``non-empty``: a field's constraints."""
    texts = []
    for item in metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                texts.append(f"{symbol} {getattr(item, attr)}")
        if isinstance(item, annotated_types.MinLen):
            texts.append("non-empty")
    return texts
