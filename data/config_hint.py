"""A config key that is no field, named with the field it was probably meant to be, as
``earlyfuse-train`` names one in a run ("did you mean ...?")."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys


def unknown_key(error: TypeError, schema: type) -> str:
    """``error``, raised by building the dataclass ``schema`` or another of its module (a section
    of it) from a mapping, as "unknown key 'seq_lenn' (did you mean seq_len?)"; any other
    TypeError as Python words it."""
    got = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(error))
    found = got and getattr(sys.modules[schema.__module__], got[1], None)
    if not got or not (isinstance(found, type) and dataclasses.is_dataclass(found)):
        return str(error)
    close = nearest_field(got[2], found)
    return f"unknown key {got[2]!r}" + (f" (did you mean {close}?)" if close else "")


def nearest_field(key: str, schema: type) -> str | None:
    """The field of the dataclass ``schema`` whose name is nearest ``key``, if one is near."""
    return nearest(key, [field.name for field in dataclasses.fields(schema)])


def nearest(key: str, names) -> str | None:
    """The name among ``names`` nearest ``key``, if one is near."""
    return next(iter(difflib.get_close_matches(key, list(names), n=1)), None)
