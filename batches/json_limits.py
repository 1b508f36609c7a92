"""JSON of bounded nesting, read without recursion.

Python's json module, Django's templates and psycopg's adapters recurse once
per level of nesting: a document a thousand arrays deep raises RecursionError
wherever it is parsed, dumped or rendered, and which of them fails first
depends on how deep the stack already is. So Recall bounds nesting where JSON
comes in and where it is read back:

* both APIs refuse a body nested deeper than ``MAX_JSON_DEPTH`` levels
  (``nested_deeper_than``, a linear scan of the text, before parsing);
* every JSON column is read through ``StoredJSONDecoder``, which turns what
  lies deeper than that into its JSON text (a string) and integers past
  Python's digit limit into their digits, so rows written before these limits
  (or by hand) still show on every page and in every export.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate
from typing import Any

# Arrays and objects within each other, the outermost counting 1. A transcript
# needs four ({"result": {"segments": [{...}]}}); 32 leaves room for any
# engine's extra fields, and is far from every recursion limit.
MAX_JSON_DEPTH = 32

# A JSON string literal, escapes included (the unrolled form: linear, no
# backtracking), and a run of anything that is not a bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
# Opening brackets count +1, closing ones -1 (as signed bytes).
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def nested_deeper_than(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON document ``text`` nests arrays and objects more than
    ``limit`` levels deep, found in linear time without recursing (brackets
    inside strings do not count). For text that is not JSON the answer means
    nothing, but it is an answer: the parser then says what is wrong."""
    if text.count("[") + text.count("{") <= limit:
        return False  # not enough brackets to nest that deep
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    steps = array("b", brackets.encode("ascii").translate(_STEPS))
    return max(accumulate(steps), default=0) > limit


def flatten_deeper_than(text: str, limit: int = MAX_JSON_DEPTH) -> str:
    """The JSON document ``text`` with every array or object that lies deeper
    than ``limit`` levels replaced by a string holding its JSON text: the same
    data, nested ``limit`` levels at most."""
    parts: list[str] = []
    depth, copied, start = 0, 0, 0
    for token in _TOKEN.finditer(text):
        char = token.group()
        if char[0] == '"':
            continue
        if char in "[{":
            depth += 1
            if depth == limit + 1:
                start = token.start()
        else:
            if depth == limit + 1:
                parts.append(text[copied:start])
                parts.append(json.dumps(text[start : token.end()], ensure_ascii=False))
                copied = token.end()
            depth -= 1
    parts.append(text[copied:])
    return "".join(parts)


def _int_or_digits(digits: str) -> int | str:
    """An integer, or its digits as a string when Python will not convert them
    (more than ``sys.get_int_max_str_digits()``, 4,300 by default)."""
    try:
        return int(digits)
    except ValueError:
        return digits


class StoredJSONDecoder(json.JSONDecoder):
    """The decoder of every JSON column (``JSONField(decoder=...)``): reads any
    stored value without raising, whatever its shape. What lies deeper than
    ``MAX_JSON_DEPTH`` comes back as its JSON text, an integer past Python's
    digit limit as its digits; anything else exactly as stored."""

    def decode(self, s: str, *args: Any) -> Any:
        if nested_deeper_than(s):
            s = flatten_deeper_than(s)
        try:
            return super().decode(s, *args)
        except json.JSONDecodeError:
            raise
        except ValueError:  # an integer with too many digits
            return json.JSONDecoder(parse_int=_int_or_digits).decode(s)
