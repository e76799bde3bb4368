"""The shape of the option sections in an ``arctic-rl fit`` config, checked as the file is read: each section
(``model.init_args.sampling``, ...) and each nested option (``rollout.environment``, ``rollout.overlong_buffer``)
is a mapping of its own fields, so a list, a ``null`` or a misspelt key is one line naming the field and what it
takes, instead of the parser's "does not validate against any of the Union subtypes".
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from arctic_rl.errors import ConfigError
from arctic_rl.options import SECTIONS


def check_sections(args: dict[str, Any], where: str) -> None:
    """Each section in ``args`` (the module's ``init_args``, at config path ``where``) has the shape of its class."""
    for section, cls in SECTIONS.items():
        if section in args:
            check_mapping(args[section], cls, f"{where}.{section}", optional=False)


def check_mapping(value: Any, cls: type, path: str, optional: bool) -> None:
    """``value`` (at ``path``) is a mapping of ``cls``'s fields (or None where ``optional``); nested options too."""
    names = [f.name for f in fields(cls)]
    if value is None and optional:
        return
    if path.endswith("rollout.environment") and isinstance(value, dict) and {"class_path", "init_args"} & set(value):
        example = "{env_class: %s, env_args: %s}" % (value.get("class_path", "my_env.MyEnvironment"), _flow(value.get("init_args", {})))
        raise ConfigError(f"{path} is given as env_class and env_args, not class_path / init_args: e.g. environment: {example}")
    if not isinstance(value, dict):
        got = "null (leave the section out for its defaults)" if value is None else f"{type(value).__name__} {value!r}"
        raise ConfigError(f"{path} must be a mapping of its fields ({', '.join(names)}), e.g. {path.rsplit('.', 1)[-1]}:"
                          f" {{{names[0]}: ...}}; got {got}")
    for key in value:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path} has no field {key!r}{hint}; its fields are {', '.join(names)}")
    hints = typing.get_type_hints(cls)
    for name in names:
        nested, optional_field = _option_class(hints.get(name))
        if nested is not None and name in value:
            check_mapping(value[name], nested, f"{path}.{name}", optional_field)


def _option_class(hint: Any) -> tuple[type | None, bool]:
    """``(dataclass, may be None)`` of a field annotated ``SomeOptions`` or ``SomeOptions | None``; ``(None, _)`` otherwise."""
    if isinstance(hint, type) and is_dataclass(hint):
        return hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        classes = [a for a in args if isinstance(a, type) and is_dataclass(a)]
        if len(classes) == 1 and len(args) == 2 and type(None) in args:
            return classes[0], True
    return None, False


def _flow(value: Any) -> str:
    """``value`` in YAML's one-line flow style."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
