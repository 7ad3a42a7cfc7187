"""Config structs are the one place a default lives; flags, YAML keys and docs derive from them.

A component declares its settings as a `msgspec.Struct` whose fields carry a description:

    class SimConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        engines: Annotated[int, Meta(ge=1, description="simulated engines, one port each")] = 2

`add_struct_arguments(parser, SimConfig)` adds `--engines` with that default and help;
`struct_from_args(SimConfig, args, yaml_path)` builds the struct from a YAML file (optional)
overridden by the flags the user actually typed, validating every value through msgspec.

A list field is one comma-separated flag; with `Meta(extra=REPEATED)` it is a flag given once per
item instead (`--variant a:X=1,Y=2 --variant b:Z=3`), for items that may hold commas themselves.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import msgspec
import yaml

_UNSET: Any = object()
S = TypeVar("S", bound=msgspec.Struct)
REPEATED = {"repeated": True}  # Meta(extra=REPEATED) on a list field: one flag per item, not a comma list


class ConfigError(ValueError):
    """Bad configuration; the message names the key and the reason, on one line."""


def _field_info(struct_type: type[msgspec.Struct]) -> list[tuple[str, Any, Any, str]]:
    """(name, type, default, description) for each field of a config struct."""
    hints = get_type_hints(struct_type, include_extras=True)
    out = []
    for field in msgspec.structs.fields(struct_type):
        hint = hints[field.name]
        description = ""
        base = hint
        if get_origin(hint) is typing.Annotated:
            base, *extras = get_args(hint)
            for extra in extras:
                if isinstance(extra, msgspec.Meta) and extra.description:
                    description = extra.description
        default = field.default
        if default is msgspec.NODEFAULT and field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        out.append((field.name, base, default, description))
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(tp: Any) -> bool:
    return tp is bool


def _scalar(tp: Any) -> Any:
    """The element type argparse should convert to: Optional[X] -> X, list[X] -> X."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _scalar(args[0]) if len(args) == 1 else str
    if origin in (list, tuple):
        return _scalar(get_args(tp)[0]) if get_args(tp) else str
    if tp in (int, float, str):
        return tp
    return str


def add_struct_arguments(parser: argparse.ArgumentParser, struct_type: type[msgspec.Struct]) -> None:
    """Add one flag per struct field; the struct's default and description become the help."""
    repeated = _repeated_fields(struct_type)
    for name, tp, default, description in _field_info(struct_type):
        shown = "" if default is msgspec.NODEFAULT else f" (default: {_show(default)})"
        if _is_bool(tp):
            parser.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=_UNSET,
                help=f"{description}{shown}",
            )
            continue
        kwargs: dict[str, Any] = {"dest": name, "default": _UNSET, "help": f"{description}{shown}"}
        if name in repeated:
            kwargs.update(type=_scalar(tp), action=_Repeated, help=f"{description}; repeatable{shown}")
        elif get_origin(tp) in (list, tuple):
            kwargs["type"] = _comma_list(_scalar(tp))
            kwargs["metavar"] = "A,B,..."
        else:
            kwargs["type"] = _scalar(tp)
        parser.add_argument(_flag(name), **kwargs)


def _repeated_fields(struct_type: type[msgspec.Struct]) -> set[str]:
    """The list fields marked Meta(extra=REPEATED)."""
    return {
        name
        for name, hint in get_type_hints(struct_type, include_extras=True).items()
        if get_origin(hint) is typing.Annotated
        and any(isinstance(m, msgspec.Meta) and (m.extra or {}).get("repeated") for m in get_args(hint)[1:])
    }


class _Repeated(argparse.Action):
    """Each use of the flag adds one item; the first replaces the struct's default list."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        given = getattr(namespace, self.dest, _UNSET)
        setattr(namespace, self.dest, [*([] if given is _UNSET else given), values])


def _show(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "none"
    if value is None:
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _comma_list(convert: Any) -> Any:
    def parse(text: str) -> list[Any]:
        return [convert(part.strip()) for part in text.split(",") if part.strip()]

    parse.__name__ = f"comma-separated {getattr(convert, '__name__', 'value')}"
    return parse


def struct_from_args(struct_type: type[S], args: argparse.Namespace, yaml_path: str | Path | None = None) -> S:
    """YAML file values, then flags the user typed, validated into `struct_type`."""
    values: dict[str, Any] = {}
    if yaml_path:
        values.update(load_yaml_mapping(yaml_path))
    for name, *_ in _field_info(struct_type):
        given = getattr(args, name, _UNSET)
        if given is not _UNSET:
            values[name] = given
    return struct_from_mapping(struct_type, values)


def struct_from_mapping(struct_type: type[S], values: dict[str, Any]) -> S:
    """Validate a mapping (YAML keys may use '-' or '_') into `struct_type`."""
    normalised = {str(k).replace("-", "_"): v for k, v in values.items()}
    try:
        return msgspec.convert(normalised, struct_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {_flagify(str(exc))}") from None


def _flagify(message: str) -> str:
    # msgspec names the offending field as `$.field_name`; operators know it as --field-name.
    return re.sub(r"`\$\.([a-z0-9_]+)", lambda m: "`" + _flag(m.group(1)), message)


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; errors name the file."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings, not {type(data).__name__}")
    return data


def flag_table(struct_type: type[msgspec.Struct]) -> str:
    """A markdown table of a struct's flags, for the README (generated, never hand-written)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, _tp, default, description in _field_info(struct_type):
        shown = "required" if default is msgspec.NODEFAULT else f"`{_show(default)}`"
        rows.append(f"| `{_flag(name)}` | {shown} | {description} |")
    return "\n".join(rows)
