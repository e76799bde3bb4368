"""The old flat option keys (``model.init_args.temperature``, ``GRPOModule(temperature=...)``), read for one
release as aliases of their place in a section (``model.init_args.sampling.temperature``), each with a
:class:`DeprecatedOptionKey` warning naming the new key; and the hyperparameters of a checkpoint
saved with them, read by their sectioned names.

A flat key is a field's name: every field name is unique over the sections (``options.SECTIONS``), so the
alias table is derived from them and a new field needs no entry. ``dotted_options`` reads a checkpoint's
hyperparameters of either form by their sectioned names. ``loss_kwargs`` (a dict of
``LossConfig`` constants) maps each of its keys into ``loss``. One option set twice (a flat key beside its
section's key, a ``loss_kwargs`` key beside ``loss``'s) is a ``ConfigError`` naming both keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any

from arctic_rl.errors import ConfigError
from arctic_rl.options import SECTIONS

# old flat key -> its section (the field keeps its name)
FLAT_KEYS: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
LOSS_KWARGS = "loss_kwargs"  # the old dict of LossConfig constants
CLI_BOOKKEEPING = ("_class_path", "_instantiator")  # LightningCLI's, in a checkpoint's hyperparameters: not options


class DeprecatedOptionKey(FutureWarning):
    """A flat option key was used; the message names the new key. (A ``FutureWarning``: shown to users by default.)"""


def _key_name(where: str, key: str) -> str:
    """How ``where`` (a class, or a config path such as ``model.init_args``) names its key ``key``."""
    return f"{where}.{key}" if where.startswith("model") else f"{where} argument {key}"


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecatedOptionKey, stacklevel=4)


def nest_flat_options(flat: Mapping[str, Any], where: str = "GRPOModule") -> dict[str, dict[str, Any]]:
    """``{section: {field: value}}`` of flat options ``flat``, one warning per key naming its new key (in ``where``'s terms).

    Raises:
        TypeError: a key that is no option's, as Python does for an unexpected keyword argument.
        ConfigError: one field set twice (a flat key and a ``loss_kwargs`` key), naming both.
    """
    flat_routes(flat, where)  # each key known, each field once
    nested: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key == LOSS_KWARGS:
            _warn(_key_name(where, LOSS_KWARGS), _key_name(where, "loss") + " (its keys are loss's fields)")
            nested.setdefault("loss", {}).update(value or {})
        elif key in FLAT_KEYS:
            _warn(_key_name(where, key), _key_name(where, f"{FLAT_KEYS[key]}.{key}"))
            nested.setdefault(FLAT_KEYS[key], {})[key] = value
    return nested


def flat_routes(flat: Mapping[str, Any], where: str) -> dict[tuple[str, str], str]:
    """``{(section, field): the key that sets it}`` of flat options ``flat`` (``loss_kwargs.clip_high`` for a
    ``loss_kwargs`` key), each field once.

    Raises:
        TypeError: a key that is no option's, as Python does for an unexpected keyword argument.
        ConfigError: an unknown ``loss_kwargs`` key, or one field set by two keys (named both).
    """
    routes: dict[tuple[str, str], str] = {}
    for key, value in flat.items():
        if key in CLI_BOOKKEEPING:  # load_from_checkpoint passes them back
            continue
        if key == LOSS_KWARGS:
            unknown = sorted(set(value or {}) - {f.name for f in fields(SECTIONS["loss"])})
            if unknown:
                raise ConfigError(f"model.loss_kwargs: unknown keys {unknown}; see arctic_rl.modules.losses.LossConfig")
            keys = {("loss", name): _key_name(where, f"{LOSS_KWARGS}.{name}") for name in value or {}}
        elif key in FLAT_KEYS:
            keys = {(FLAT_KEYS[key], key): _key_name(where, key)}
        else:
            raise TypeError(f"{where} got an unexpected keyword argument {key!r}")
        for place, name in keys.items():
            if place in routes:
                raise twice(routes[place], name, _key_name(where, ".".join(place)))
            routes[place] = name
    return routes


def twice(first: str, second: str, new: str) -> ConfigError:
    """The error for one setting given as both ``first`` and ``second``; ``new`` is its key in the sectioned form."""
    return ConfigError(f"{first} and {second} both set one option: keep only {new} (the flat keys and loss_kwargs are deprecated)")


def section_value(section: str, given: Any, flat: Mapping[str, Any] | None = None) -> Any:
    """Section ``section`` as a dataclass: ``given`` (an instance, a dict as a checkpoint's hyperparameters keep
    it, or None: the defaults) with the ``flat`` fields of it set over it. A bad value is a ``ConfigError``
    naming ``model.<section>.<field>``, and so is a ``flat`` field that ``given`` sets too (a dict's key, or an
    instance's field away from its default)."""
    cls = SECTIONS[section]
    if isinstance(given, cls) and not flat:
        return given
    for key in flat or {}:
        if key in _set_fields(cls, given):
            raise twice(f"GRPOModule argument {key}", *[f"GRPOModule argument {section}.{key}"] * 2)
    values = {**(asdict(given) if is_dataclass(given) else dict(given or {})), **(flat or {})}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # the classes shared with the service name a field alone, or as model.<field>
        message = str(e)
        if not message.startswith(f"model.{section}."):
            message = f"model.{section}.{message.removeprefix('model.')}"
        raise ConfigError(message) from None


def _set_fields(cls: type, given: Any) -> set[str]:
    """The fields a section's value sets: a dict's keys, or an instance's fields that differ from their default."""
    if isinstance(given, Mapping):
        return set(given)
    if not is_dataclass(given):
        return set()
    default = cls()
    return {f.name for f in fields(cls) if getattr(given, f.name) != getattr(default, f.name)}


def dotted_options(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``{dotted name: value}`` of module hyperparameters in the sectioned form or the old flat one (an old
    checkpoint's): each section's field as ``<section>.<field>``, the other arguments (``model``, ``dtype``) by name."""
    dotted: dict[str, Any] = {}
    for key, value in hparams.items():
        if key in SECTIONS and (isinstance(value, Mapping) or is_dataclass(value)):
            dotted.update({f"{key}.{k}": v for k, v in (asdict(value) if is_dataclass(value) else value).items()})
        elif key == LOSS_KWARGS:
            dotted.update({f"loss.{k}": v for k, v in (value or {}).items()})
        elif key in FLAT_KEYS:
            dotted[f"{FLAT_KEYS[key]}.{key}"] = value
        else:
            dotted[key] = value
    return dotted


def upgrade_config(config: Any) -> Any:
    """A parsed ``arctic-rl fit`` config with the flat keys under ``model.init_args`` (or ``model``) moved into
    their sections, one warning each. A setting given twice (a flat key and its section's, or a ``loss_kwargs``
    key and ``loss``'s) is a ``ConfigError`` naming both; each section must be a mapping of its fields
    (``config_shape.py``)."""
    from arctic_rl.modules.config_shape import check_sections

    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return config
    args = model.get("init_args") if isinstance(model.get("init_args"), dict) else model
    where = "model.init_args" if args is not model else "model"
    check_sections(args, where)
    flat = {k: args[k] for k in args if k in FLAT_KEYS or k == LOSS_KWARGS}
    for (section, field), key in flat_routes(flat, where).items():
        if field in (args.get(section) or {}):
            raise twice(key, f"{where}.{section}.{field}", f"{where}.{section}.{field}")
    for key in flat:
        args.pop(key)
    for section, values in nest_flat_options(flat, where).items():
        args[section] = {**(args.get(section) or {}), **values}
    return config


def upgrade_args(argv: list[str]) -> list[str]:
    """Command-line flags ``--model.init_args.<flat key>`` / ``--model.<flat key>`` (``=value`` or not) renamed
    to their section's, one warning each."""
    given = {arg.partition("=")[0] for arg in argv}
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        for prefix in ("--model.init_args.", "--model."):
            key = name.removeprefix(prefix)
            if name.startswith(prefix) and key in FLAT_KEYS:
                new = f"{prefix}{FLAT_KEYS[key]}.{key}"
                if new in given:
                    raise twice(name, new, new)
                _warn(name, new)
                arg = f"{new}{eq}{value}"
                break
        out.append(arg)
    return out


def move_old_keys(data: dict[str, Any], old_keys: Mapping[str, str]) -> dict[str, Any]:
    """``data`` (a config's fields, ``section.field`` deep at most) with each dotted key of ``old_keys`` moved to its
    new ``section.field``, one ``DeprecatedOptionKey`` warning each; an old section left empty is dropped.

    Raises:
        ConfigError: a key given under its old and its new name, naming both.
    """
    data = {key: dict(value) if isinstance(value, Mapping) else value for key, value in data.items()}
    for old, new in old_keys.items():
        old_section, _, old_field = old.rpartition(".")
        holder = data.get(old_section) if old_section else data
        new_section, _, new_field = new.partition(".")
        if not isinstance(holder, dict) or old_field not in holder or not isinstance(data.setdefault(new_section, {}), dict):
            continue  # not given, or a section that is no mapping: its own error names it
        if new_field in data[new_section]:
            raise ConfigError(f"{old} and {new} both set one option: keep only {new} ({old} is deprecated)")
        warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecatedOptionKey, stacklevel=2)
        data[new_section][new_field] = holder.pop(old_field)
        if old_section and not holder:
            data.pop(old_section)
    return data
