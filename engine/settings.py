"""Settings declared once: each is an attrs field whose metadata holds its help text.

From that one declaration follow the ``TRILLM_*`` environment variable, the
command-line flag, the parsing of both, ``--help`` and the README's table, so a
new knob is one line in one class. Engine settings live in
``trillm.engine.config``; the HTTP layer's in ``trillm.api.settings``.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs

ENV_PREFIX = "TRILLM_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
T = TypeVar("T")


@attrs.frozen
class Setting:
    """How one field is spelled outside Python: variable, flag, help, and how to read text."""

    name: str
    kind: type  # str, int, float or bool (None allowed where the field is Optional); a tuple's item type
    optional: bool
    many: bool  # a tuple: the variable takes a comma list, the flag repeats (each a comma list too)
    default: Any
    help: str
    choices: tuple[str, ...] | None
    env: str
    flag: str  # for bools that default on, the flag that turns them off
    doc_default: str  # the README's "default" column
    scale: float  # environment/flag value * scale = field value (e.g. MB -> bytes)
    secret: bool  # never echoed (API keys): not in reprs nor in error messages

    def parse(self, text: str) -> Any:
        """The field's value from an environment variable's text; ValueError if it is not one."""
        if self.many:
            return tuple(self._parse_one(item) for item in text.split(",") if item.strip())
        return self._parse_one(text)

    def _parse_one(self, text: str) -> Any:
        text = text.strip()
        if self.optional and text.lower() in ("", "none"):
            return None
        if self.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"expected one of {'/'.join(_TRUE + _FALSE)}")
        if self.choices is not None and text not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}")
        if self.kind is str:
            return text
        value = float(text) if self.kind is float or self.scale != 1 else int(text)
        return self.kind(value * self.scale) if self.scale != 1 else value


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    env: str | None = None,
    doc_default: str | None = None,
    scale: float = 1,
    validator: Callable[[Any, Any, Any], None] | None = None,
    secret: bool = False,
) -> Any:
    """An attrs field that is also a setting; names default to ``--field-name`` and ``TRILLM_FIELD_NAME``.

    A ``tuple[X, ...]`` field takes a comma list in its variable and a repeatable flag. A ``secret``
    one (API keys) is left out of the class's repr and of error messages, so it is never logged."""
    meta = {
        "setting": dict(
            help=help, choices=choices, flag=flag, env=env, doc_default=doc_default, scale=scale, secret=secret
        )
    }
    return attrs.field(default=default, metadata=meta, validator=validator, repr=not secret)


def settings_of(cls: type) -> Iterator[Setting]:
    """Every setting of an attrs class, in declaration order."""
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        spec = field.metadata.get("setting")
        if spec is None:
            continue
        kind, optional = _unwrap(hints[field.name])
        many = typing.get_origin(kind) is tuple
        if many:
            kind = typing.get_args(kind)[0]
        default = field.default
        flag = spec["flag"] or "--" + field.name.replace("_", "-")
        shown = "none" if default is None or default == () else _show(default, spec["scale"])
        doc_default = spec["doc_default"] or shown
        yield Setting(
            field.name,
            kind,
            optional,
            many,
            default,
            spec["help"],
            spec["choices"],
            spec["env"] or ENV_PREFIX + field.name.upper(),
            flag,
            doc_default,
            spec["scale"],
            spec["secret"],
        )


def _unwrap(hint: Any) -> tuple[type, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def _show(value: Any, scale: float) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ", ".join(map(str, value))
    if scale != 1:
        value = value / scale
        return str(int(value)) if value == int(value) else str(value)
    return str(value)


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """An instance of ``cls`` from ``TRILLM_*`` variables; ``overrides`` that are not None (flags) win.

    Raises ``SystemExit`` naming the variable or field for a bad value: this runs at startup.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for s in settings_of(cls):
        raw = env.get(s.env)
        if raw is None or raw == "":
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            raise SystemExit(f"{s.env}={'<hidden>' if s.secret else repr(raw)} is not valid: {exc}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"invalid trillm configuration: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting of ``cls``; each defaults to None (not given), so the environment can fill it."""
    group = parser.add_argument_group(f"{cls.__name__} (flags win over the environment variable named)")
    for s in settings_of(cls):
        text = f"{s.help} [{s.env}; default {s.doc_default}]".replace("%", "%%")
        if s.kind is bool:
            action = "store_false" if s.default else "store_true"
            group.add_argument(s.flag, dest=s.name, action=action, default=None, help=text)
        elif s.many:
            group.add_argument(
                s.flag,
                dest=s.name,
                type=_flag_type(s),
                action=_Extend,
                default=None,
                metavar=s.flag.lstrip("-").replace("-", "_").upper(),
                help=text + " (repeatable; each may be a comma list)",
            )
        else:
            group.add_argument(
                s.flag,
                dest=s.name,
                type=_flag_type(s),
                default=None,
                # argparse compares the converted value with its choices: a number's are checked on the text
                # (Setting.parse) and shown as the metavar, so `--activation-bits 8` is one
                choices=s.choices if s.kind is str else None,
                metavar=_metavar(s),
                help=text,
            )


class _Extend(argparse.Action):
    """A repeatable flag whose values (each a parsed tuple) add up to one tuple."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, (getattr(namespace, self.dest, None) or ()) + tuple(values))


def _metavar(s: Setting) -> str | None:
    if s.choices is None:
        return s.flag.lstrip("-").replace("-", "_").upper()
    return None if s.kind is str else "{" + ",".join(s.choices) + "}"


def _flag_type(s: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = s.kind.__name__  # argparse names the type in its error
    return parse


def overrides_from(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of ``cls`` that were given on the command line."""
    return {s.name: getattr(args, s.name) for s in settings_of(cls) if getattr(args, s.name, None) is not None}


def markdown_table(*classes: type) -> str:
    """The README's table of settings: flag, variable, default, meaning."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for cls in classes:
        for s in settings_of(cls):
            meaning = s.help + (f" ({', '.join(f'`{c}`' for c in s.choices)})" if s.choices else "")
            if s.kind is bool and s.default:
                meaning += "; the flag turns it off, as does `0`/`off` in the variable"
            if s.many:
                meaning += "; a comma list in the variable, the flag repeatable"
            cells = [f"`{s.flag}`", f"`{s.env}`", s.doc_default, meaning.replace("|", "\\|")]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
