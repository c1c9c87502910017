"""Turn pydantic validation errors into the engine's config-error phrasing.

Config loaders prefix the location themselves (file, dataset, node, variable); this module
only says which key is at fault and what was wrong with it, e.g. ``("task_type", "must be a
string, got 3")``.
"""

from __future__ import annotations

from collections.abc import Iterable
from difflib import get_close_matches

from pydantic import ValidationError
from pydantic_core import ErrorDetails

__all__ = ["explain", "format_location", "unknown_key_message"]

_PHRASES = {
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "path_type": "must be a path",
}


def format_location(loc: tuple[int | str, ...]) -> str:
    """``("metadata_keys", 1)`` -> ``"metadata_keys[1]"``; ``("a", "b")`` -> ``"a.b"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _problem(error: ErrorDetails) -> str:
    kind = error["type"]
    ctx = error.get("ctx", {})
    got = f", got {error['input']!r}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a known key"
    if kind in _PHRASES:
        return _PHRASES[kind] + got
    if kind == "greater_than":
        return f"must be greater than {ctx['gt']}{got}"
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']}{got}"
    if kind == "less_than":
        return f"must be less than {ctx['lt']}{got}"
    if kind == "less_than_equal":
        return f"must be at most {ctx['le']}{got}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item(s){got}"
    if kind in ("literal_error", "enum"):
        return f"must be one of {ctx['expected']}{got}"
    message = error["msg"]
    if kind in ("value_error", "assertion_error"):  # our validators' own words
        return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return message[:1].lower() + message[1:] + got


def explain(exc: ValidationError) -> list[tuple[str, str]]:
    """One ``(key, problem)`` per error; ``key`` is ``""`` for a whole-record rule."""
    return [
        (format_location(tuple(error["loc"])), _problem(error))
        for error in exc.errors(include_url=False)
    ]


def unknown_key_message(key: object, known: Iterable[str]) -> str:
    """``unknown key 'tasktype' (did you mean 'task_type'?)`` or a list of the known keys."""
    names = sorted(known)
    close = get_close_matches(str(key), names, n=1) if isinstance(key, str) else []
    hint = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(names)
    return f"unknown key {key!r} ({hint})"
