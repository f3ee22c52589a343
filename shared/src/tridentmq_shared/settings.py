"""Settings: defaults defined once in frozen dataclasses, overridden by a TOML file, then by environment.

A settings class is a dataclass of *sections* (dataclasses of scalar fields). Every field documents
itself through ``doc(...)``; ``render_reference`` turns the classes into the configuration reference in
``docs/``, so the docs cannot drift from the code. Environment variables are named
``{PREFIX}_{SECTION}_{FIELD}`` in upper case, e.g. ``TRIDENTMQ_CORE_LINK_PORT=61617``.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting has a value of the wrong type or an unknown name."""


def doc(
    default: Any, text: str, *, factory: bool = False, least: float | None = None, most: float | None = None
) -> Any:
    """Declare a documented setting (use ``factory=True`` for list defaults). ``least`` and ``most``: the
    values a process works under (an interval of 0 spins, a window of 0 stalls, a protocol field has its
    width); one outside them is refused as the settings load, naming the key."""
    metadata: dict[str, Any] = {"doc": text}
    if least is not None:
        metadata["least"] = least
    if most is not None:
        metadata["most"] = most
    if factory:
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _number(value: float) -> str:
    """A bound or a value as an operator writes it: 4294967295, not 4.29497e+09; 0.5, not 0.500000."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise SettingsError(f"{where}: expected a list")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, Mapping):
            raise SettingsError(f"{where}: expected a table")
        return _build(hint, value, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise SettingsError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise SettingsError(f"{where}: expected an integer, got {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            raise SettingsError(f"{where}: expected an integer, got {value!r}") from None
        if where.rpartition(".")[2].endswith("port") and not -1 <= number <= 65535:
            raise SettingsError(f"{where}: a port is from 0 to 65535 (-1: off, where it may be), got {number}")
        return number
    if hint is float:
        try:
            real = float(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{where}: expected a number, got {value!r}") from None
        if not math.isfinite(real):
            raise SettingsError(f"{where}: expected a finite number, got {value!r}")
        return real
    if hint is Path:
        return Path(str(value))
    if hint is str:
        if not isinstance(value, str):
            raise SettingsError(f"{where}: expected a string, got {value!r}")
        if where.rpartition(".")[2] == "log_level" and value.upper() not in _LOG_LEVELS:
            raise SettingsError(f"{where}: expected one of {', '.join(_LOG_LEVELS)}, got {value!r}")
        return value
    raise SettingsError(f"{where}: unsupported setting type {hint!r}")


def _build(cls: type[T], values: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(values) - names
    if unknown:
        raise SettingsError(f"{where + ': ' if where else ''}unknown setting(s) {', '.join(sorted(unknown))}")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in values.items()}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = kwargs.get(field.name)
        if value is None or not ({"least", "most"} & field.metadata.keys()):
            continue
        key = f"{where}.{field.name}" if where else field.name
        least, most = field.metadata.get("least"), field.metadata.get("most")
        if least is not None and value < least:
            raise SettingsError(f"{key} is at least {_number(least)}, got {_number(value)}")
        if most is not None and value > most:
            raise SettingsError(f"{key} is at most {_number(most)}, got {_number(value)}")
    return cls(**kwargs)


def load_settings(
    cls: type[T],
    *,
    prefix: str,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> T:
    """Defaults ← TOML ``file`` ← environment variables ``{prefix}_{SECTION}_{FIELD}``."""
    data: dict[str, Any] = {}
    if file is not None:
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise SettingsError(f"cannot read {file}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{file}: {exc}") from None
    hints = typing.get_type_hints(cls)
    for section in dataclasses.fields(cls):  # type: ignore[arg-type]
        section_cls = hints[section.name]
        if not dataclasses.is_dataclass(section_cls):
            continue
        for field in dataclasses.fields(section_cls):
            key = f"{prefix}_{section.name}_{field.name}".upper()
            if env is not None and key in env:
                data.setdefault(section.name, {})[field.name] = env[key]
    return _build(cls, data, "")


def render_reference(title: str, cls: type[Any], prefix: str, intro: str = "") -> str:
    """Markdown reference of every setting of ``cls`` with its default, from the code itself."""
    lines = [f"## {title}", ""]
    if intro:
        lines += [intro, ""]
    hints = typing.get_type_hints(cls)
    for section in dataclasses.fields(cls):
        section_cls = hints[section.name]
        origin = typing.get_origin(section_cls)
        if origin is list:
            item = typing.get_args(section_cls)[0]
            lines += [f"### `[[{section.name}]]` (TOML only)", "", section.metadata.get("doc", ""), ""]
            lines += _table(item, None)
            continue
        lines += [f"### `[{section.name}]`", ""]
        if section.metadata.get("doc"):
            lines += [section.metadata["doc"], ""]
        lines += _table(section_cls, f"{prefix}_{section.name}".upper())
    return "\n".join(lines) + "\n"


def _table(cls: type[Any], env_prefix: str | None) -> list[str]:
    hints = typing.get_type_hints(cls)
    header = (
        "| setting | type | default | environment | meaning |"
        if env_prefix
        else "| setting | type | default | meaning |"
    )
    rows = [header, "|---|---|---|---|---|" if env_prefix else "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        )
        kind = _type_name(hints[f.name])
        shown = f"`{default!s}`" if default not in ("", None) else ('`""`' if default == "" else "none")
        cells = [f"`{f.name}`", kind, shown]
        if env_prefix:
            cells.append(f"`{env_prefix}_{f.name.upper()}`")
        text = f.metadata.get("doc", "")
        limits = {"at least": f.metadata.get("least"), "at most": f.metadata.get("most")}
        bounds = ", ".join(f"{word} {_number(value)}" for word, value in limits.items() if value is not None)
        if bounds:
            text += f" {bounds.capitalize()}."
        cells.append(text.replace("|", "\\|"))
        rows.append("| " + " | ".join(cells) + " |")
    return [*rows, ""]


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None)) + " (optional)"
    if origin is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return {bool: "bool", int: "int", float: "float", str: "string", Path: "path"}.get(hint, str(hint))
