"""Configuration from environment variables: declared once, parsed by one parser per kind, checked
before any dispatch.

A variable is read when it is first needed and parsed again only when its text changes. A bad
value never reaches a kernel: :func:`check` runs in every public call before the backend is
chosen and raises :class:`ConfigError` naming the variable, so a typo is the caller's error, never
a backend failure that the registry would answer by falling back. Plugins declare their own
variables with :func:`declare`; ``logprob-registry info`` lists every declared variable and its
value.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SIZE = re.compile(r"(\d+)\s*([a-zA-Z]*)")


class ConfigError(ValueError):
    """An environment variable of logprob-registry holds a value it cannot use."""


def parse_bytes(text: str) -> int:
    """A positive size in bytes: ``4194304``, ``4MiB``, ``4M``, ``512K``, ``1G`` (binary units;
    ``KB``/``MB``/``GB`` mean the same). Raises ValueError otherwise."""
    match = _SIZE.fullmatch(str(text).strip())
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None or int(match.group(1)) <= 0:
        raise ValueError("not a positive size in bytes; give a number with an optional unit, "
                         "such as 4194304, 4MiB or 512K")
    return int(match.group(1)) * unit


def positive_bytes(value: object, what: str) -> int:
    """``value`` as a positive int of bytes (an int, or a string :func:`parse_bytes` takes);
    a ValueError naming ``what`` otherwise."""
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            raise ValueError(f"{what}={value!r} is {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {value!r}")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_flag(text: str) -> bool:
    """A switch: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case).
    Raises ValueError otherwise, so a typo never silently leaves a switch off."""
    word = str(text).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"not a switch; give one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, how its text is parsed, its default, what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


_declared: Dict[str, Variable] = {}
_parsed: Dict[str, Tuple[str, Any, Optional[str]]] = {}  # name -> (text, value, error)
_lock = threading.Lock()
# The checks run on every call: they read os.environ's own mapping (one lookup per variable, no
# decoding) and parse only when a variable's raw value changed since the last check.
_environ = getattr(os.environ, "_data", None)
_keys: Dict[str, Any] = {}
_checked: Tuple[Any, List[str]] = ((), [])


def _key(name: str) -> Any:
    try:
        return os.environ.encodekey(name)  # type: ignore[attr-defined]
    except AttributeError:  # not CPython's os._Environ
        return name


def declare(variable: Variable) -> Variable:
    """Declare a variable (a plugin declares its own at import); redeclaring a name replaces it."""
    global _checked, _declared, _keys
    with _lock:  # new dicts, never changed in place: check() may be iterating the old ones in another thread
        _declared = {**_declared, variable.name: variable}
        _keys = {**_keys, variable.name: _key(variable.name)}
        _parsed.pop(variable.name, None)
        _checked = ((), [])
    return variable


def raw(name: str) -> Any:
    """The raw value of environment variable ``name`` (None when unset), read cheaply."""
    if _environ is not None:
        return _environ.get(_keys.get(name) or _key(name))
    return os.environ.get(name)


def reader(name: str) -> Callable[[], Any]:
    """A function returning the raw value of environment variable ``name`` (None when unset): what
    :func:`raw` returns, for a check made on every call (one C-level lookup, no Python frame)."""
    if _environ is not None:
        return functools.partial(_environ.get, _key(name))
    return functools.partial(os.environ.get, name)


def declared() -> List[Variable]:
    return sorted(_declared.values(), key=lambda v: v.name)


def _read(variable: Variable) -> Tuple[Any, Optional[str]]:
    text = os.environ.get(variable.name, "").strip()
    cached = _parsed.get(variable.name)
    if cached is not None and cached[0] == text:
        return cached[1], cached[2]
    if not text:
        value, error = variable.default, None
    else:
        try:
            value, error = variable.parse(text), None
        except ValueError as exc:
            value, error = variable.default, f"{variable.name}={text!r} is {exc}"
    _parsed[variable.name] = (text, value, error)
    return value, error


def get(name: str) -> Any:
    """The parsed value of declared variable ``name`` (its default when unset); ConfigError when
    its text cannot be parsed."""
    value, error = _read(_declared[name])
    if error:
        raise ConfigError(error)
    return value


def problems() -> List[str]:
    """One sentence for each declared variable whose value cannot be used."""
    return [error for error in (_read(v)[1] for v in declared()) if error]


def check() -> None:
    """Raise ConfigError naming every unusable variable (about a microsecond when nothing changed)."""
    global _checked
    if _environ is not None:
        state = tuple(map(_environ.get, _keys.values()))
        if state != _checked[0]:
            _checked = (state, problems())
        errors = _checked[1]
    else:
        errors = problems()
    if errors:
        raise ConfigError("; ".join(errors) + ". Fix or unset the variable.")


def describe() -> List[Tuple[str, str, str]]:
    """``(name, value in force or "unset", what it does)`` for every declared variable."""
    rows = []
    for v in declared():
        text = os.environ.get(v.name, "").strip()
        _, error = _read(v)
        shown = "unset" if not text else (f"{text} (INVALID)" if error else text)
        rows.append((v.name, shown, v.doc))
    return rows


BACKEND = declare(Variable(
    "LOGPROB_REGISTRY_BACKEND", str, "",
    "force this backend process-wide (explicit choice: never a silent fallback)"))
STRICT = declare(Variable(
    "LOGPROB_REGISTRY_STRICT", parse_flag, False,
    "1: strict mode process-wide (as lr.strict()): no run-time fallback, and the automatic choice only "
    "among backends that promise batch invariance and determinism (group invariance with process_group)"))


def _memory_mode(text: str) -> str:
    word = text.strip().lower()
    if word not in ("promise", "speed"):
        raise ValueError('neither "promise" (the default: the automatic choice keeps each op\'s memory promise) '
                         'nor "speed" (the fastest, even one that breaks it)')
    return word


MEMORY = declare(Variable(
    "LOGPROB_REGISTRY_MEMORY", _memory_mode, "promise",
    "speed: the automatic choice takes the fastest backend even where it breaks the op's memory promise (the fused "
    "op forming the (N, V) logits); promise (default): a backend breaking it is passed over (docs/tuning.md)"))
