"""Validation of the names users choose: entry names, run names and tags.

Names never become paths in this store, but they are shown in reports,
exported to files and used as selectors, so path tricks are refused early.
"""

from __future__ import annotations

import re

from chunkstore.errors import InvalidNameError

MAX_NAME_LENGTH = 1024
_RUN_OR_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}\Z")  # not "$": see digest._HEX
RESERVED_SELECTORS = frozenset({"latest"})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: What nearly every entry name is (``model.layers.0.weight``): ASCII letters, digits and
#: underscores in non-empty dot-separated components.  Such a name passes every check of
#: :func:`check_entry_name` but the length, which it is checked for alone: a save and a
#: read check each of a model's hundreds of names.
_PLAIN_ENTRY = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*\Z")


def _check_common(name: object, kind: str) -> str:
    if not isinstance(name, str):
        raise InvalidNameError(repr(name), f"{kind} must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidNameError(name, f"{kind} is empty")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(name, "is not valid Unicode (a lone surrogate)") from None
    if "\x00" in name:
        raise InvalidNameError(name, "contains a NUL byte")
    if _CONTROL.search(name):
        raise InvalidNameError(name, "contains a control character")
    if ".." in name:
        raise InvalidNameError(name, "contains '..'")
    return name


def check_entry_name(name: object) -> str:
    """Entry names are dotted paths such as ``model.layers.0.weight``.

    Components are separated by ``.``; none may be empty, and ``/`` or ``\\``
    (path separators) are refused so an export can never escape its folder.
    """
    if type(name) is str and len(name) <= MAX_NAME_LENGTH and _PLAIN_ENTRY.match(name):
        return name
    return _checked_entry_name(name)


def _checked_entry_name(name: object) -> str:
    """Every check of :func:`check_entry_name`, naming what is wrong."""
    text = _check_common(name, "entry name")
    if len(text) > MAX_NAME_LENGTH:
        raise InvalidNameError(text, f"longer than {MAX_NAME_LENGTH} characters")
    if "/" in text or "\\" in text:
        raise InvalidNameError(text, "contains a path separator ('/' or '\\'); use '.'")
    if any(part == "" for part in text.split(".")):
        raise InvalidNameError(text, "has an empty component (leading, trailing or double '.')")
    return text


def check_component(name: object) -> str:
    """One component of an entry name, as a tree node stores it: no ``.`` inside."""
    text = check_entry_name(name)
    if "." in text:
        raise InvalidNameError(text, "a name component contains '.'")
    return text


def check_label(name: object, kind: str = "run name") -> str:
    """Run names and tags: letters, digits and ``_.+=-``, at most 128, no ``@``."""
    text = _check_common(name, kind)
    if not _RUN_OR_TAG.match(text):
        raise InvalidNameError(
            text, f"a {kind} uses letters, digits and '_.+=-', starts with a letter, digit or '_',"
            " and is at most 128 characters"
        )
    if text in RESERVED_SELECTORS:
        raise InvalidNameError(text, f"'{text}' is a reserved selector")
    return text
