"""Hydra's and OmegaConf's composition errors, as one ``hpctrain: error:`` line.

Hydra reports a bad override in several lines (the override, OmegaConf's
message, ``full_key``, ``reference_type``, ``object_type``, a hint about
``HYDRA_FULL_ERROR``) and exits 1. A value of the wrong type, an unknown key,
an unknown preset or an override that does not parse is a configuration
problem like any other, so it gets what every other one gets: one line
naming the key, the value, what the schema expects and the fix, and exit
status 2 on every rank (``cli.py`` broadcasts rank 0's verdict).

``explain`` reads the exception's own fields (OmegaConf's ``full_key`` and
``value``, Hydra's ``missing_cfg_file``, ``options`` and ``override``) and
the typed schema it is given (``store.explain_error`` passes the one
``store.build_schema`` makes, plugin sections included) for the expected
type, an example value and the keys a misspelt one is near. Of
Hydra's message text it reads only the preset a problem arose in, and
passes on the text of an error that has no fields. It returns None for an
exception that is not a composition error (a bug then keeps its traceback).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import traceback
import typing
from typing import Any, List, Optional, Tuple

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from hpctrain.plugins import blocked_hint

_HYDRA_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"

RENAMED = {"trainer.max_time_margin_s": ("trainer.end_margin_s", ""),
           "checkpoint.hdf5.alignment_kb": ("checkpoint.hdf5.alignment", " (bytes: 1024 x the old value)")}
"""Keys renamed, old -> (new, what else changed): the old one is refused with a line naming the new one (no
alias: one name per setting)."""


def explain(exc: BaseException, schema: type) -> Optional[str]:
    """The one line for a composition error ``exc``, or None if it is not one."""
    if isinstance(exc, MissingConfigException):
        return _missing_preset(exc)
    if isinstance(exc, OverrideParseException):
        first = str(exc).splitlines()[0] if str(exc) else "syntax error"
        return (f"cannot parse the override {exc.override!r}: {first}; write key=value "
                f"(quote a value holding , [ ] {{ }} = or spaces; Hydra's override grammar: {_HYDRA_GRAMMAR})")
    # Hydra chains OmegaConf's error as the cause, or (while merging a preset) only as the context
    cause = (exc.__cause__ or exc.__context__) if isinstance(exc, HydraException) else exc
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        preset = _preset_of(exc)
        return (f"in preset {preset}: " if preset else "") + _omegaconf_problem(cause, schema)
    if isinstance(exc, HydraException) or _raised_by_hydra(exc):
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if cause is not None and cause is not exc:
            text += f": {_first_line(cause)}"
        return f"composing the config failed: {text or type(exc).__name__}"
    return None


def _raised_by_hydra(exc: BaseException) -> bool:
    """Raised inside Hydra's own code (e.g. ``parallel=3``: "Config group
    override must be a string or a list"), not in a task it called."""
    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, ValueError) and bool(frames) and f"{os.sep}hydra{os.sep}" in frames[-1].filename


def _first_line(e: Any) -> str:
    text = str(getattr(e, "msg", None) or e)
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _preset_of(exc: BaseException) -> Optional[str]:
    """``model/tiny-moe`` when Hydra says the error arose in that preset file."""
    m = re.match(r"In '([^']+)':", str(exc))
    return m.group(1) if m and "/" in m.group(1) else None


def _missing_preset(exc: Any) -> str:
    wanted = str(getattr(exc, "missing_cfg_file", "") or "")
    group, _, name = wanted.rpartition("/")
    options = [o for o in (getattr(exc, "options", None) or []) if not o.endswith("_schema")]
    if not group:
        return f"no config named {wanted!r}" + (f"; choose one of: {', '.join(options)}" if options else "")

    hint = blocked_hint()  # the preset may be a blocked plugin's
    return (f"{group}={name}: there is no preset {name!r} in group {group}; choose one of: "
            f"{', '.join(options) or '(none)'} (hpctrain/conf/{group}/*.yaml and the plugins')"
            + (f"; {hint}" if hint else ""))


def _omegaconf_problem(cause: Any, schema: type) -> str:
    key = str(cause.full_key)
    found = _lookup(key, schema)
    if found is None:
        return _unknown_key(key, schema)
    typ, default = found
    parent = key.rpartition(".")[0]
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and parent and _is_mapping(parent, schema):
        return (f"{key}: {parent} is a mapping with no entry {key.rpartition('.')[2]!r} yet; "
                f"add one with +{key}=<value>")
    if isinstance(cause, ValidationError):
        value = getattr(cause, "value", None)
        need = _describe(typ)
        example = _example(typ, default)
        return f"{key}={_show(value)}: must be {need}" + (f", e.g. {key}={example}" if example else "")
    return f"{key}: {_first_line(cause)}"


def _is_mapping(key: str, schema: type) -> bool:
    found = _lookup(key, schema)
    return found is not None and typing.get_origin(_strip_optional(found[0])) in (dict, typing.Dict)


def _unknown_key(key: str, schema: type) -> str:
    if key in RENAMED:
        new, note = RENAMED[key]
        return f"{key} was renamed {new}{note}; use {new}=<value>"
    parts = key.split(".")
    parent = ".".join(parts[:-1])
    # the longest prefix the schema knows, and its keys
    known_at, siblings = "", _keys_at("", schema)
    for i in range(1, len(parts)):
        here = _keys_at(".".join(parts[:i]), schema)
        if here is None:
            break
        known_at, siblings = ".".join(parts[:i]), here
    bad = parts[len(known_at.split(".")) if known_at else 0]
    siblings = siblings or []
    close = difflib.get_close_matches(bad, siblings, n=1, cutoff=0.7)

    def full(k: str) -> str:
        return f"{known_at}.{k}" if known_at else k

    if known_at:
        text = f"{key} is not a config key ({known_at} has no {bad!r})"
    else:
        text = f"{key} is not a config key ({bad!r} is no group or key)"
    if close:
        text += f"; did you mean {full(close[0])}?"
    else:
        text += f"; {'the keys of ' + known_at if known_at else 'the groups'}: {', '.join(siblings)}"
    blocked = blocked_hint()
    if blocked:
        text += f"; a plugin's keys exist only while it is loaded: {blocked}"
    elif not known_at or parent != known_at:
        text += "; a plugin's keys exist only when it is installed (hpctrain-train --plugins lists them)"
    return text


def _hints(cls: type) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: the raw ones
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _lookup(key: str, schema: type) -> Optional[Tuple[Any, Any]]:
    """(declared type, default) of ``key`` in the schema; None if it has no such key."""
    cls: Any = schema
    typ: Any = cls
    default: Any = None
    for part in key.split("."):
        typ = _strip_optional(typ)
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            hints = _hints(typ)
            if part not in hints:
                return None
            field = {f.name: f for f in dataclasses.fields(typ)}[part]
            default = field.default if field.default is not dataclasses.MISSING else None
            typ = hints[part]
        elif typing.get_origin(typ) in (dict, typing.Dict):
            args = typing.get_args(typ)
            typ, default = (args[1] if len(args) == 2 else Any), None
        else:
            return None
    return typ, default


def _keys_at(prefix: str, schema: type) -> Optional[List[str]]:
    """The keys under ``prefix`` (a dataclass section); None if it is not one."""
    if prefix:
        found = _lookup(prefix, schema)
        if found is None:
            return None
        typ = _strip_optional(found[0])
    else:
        typ = schema
    if not dataclasses.is_dataclass(typ):
        return None
    return [f.name for f in dataclasses.fields(typ)]


def _strip_optional(typ: Any) -> Any:
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if typing.get_origin(typ) is typing.Union and len(args) == 1:
        return args[0]
    return typ


def _describe(typ: Any) -> str:
    inner = _strip_optional(typ)
    if inner is not typ:
        return f"null or {_describe(inner)}"
    origin = typing.get_origin(typ)
    if typ is bool:
        return "true or false (bool)"
    if typ is int:
        return "an integer (int)"
    if typ is float:
        return "a number (float)"
    if typ is str:
        return "a string (str; quote it if it holds , [ ] { } = or spaces)"
    if origin in (dict, typing.Dict):
        return "a mapping, e.g. {key: value}"
    if origin in (list, typing.List, tuple, typing.Tuple):
        return "a list, e.g. [a,b]"
    if dataclasses.is_dataclass(typ):
        names = [f.name for f in dataclasses.fields(typ)]
        return f"a group of keys ({', '.join(names)}), each set on its own"
    return getattr(typ, "__name__", str(typ))


def _example(typ: Any, default: Any) -> str:
    inner = _strip_optional(typ)
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, (int, float)) and inner in (int, float):
        return repr(default)
    if inner is int:
        return "1"
    if inner is float:
        return "0.5"
    if inner is bool:
        return "true"
    return ""


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)

