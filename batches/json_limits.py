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
# backtracking), or one bracket: the tokens flatten_deeper_than walks.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
# Opening brackets count +1, closing ones -1 (as signed bytes); every other
# byte is dropped.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def nested_deeper_than(document: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON ``document`` nests arrays and objects more than
    ``limit`` levels deep, found without recursing, in a few linear passes of
    C (a body of several megabytes costs about what parsing it does). Brackets
    inside strings do not count. For a document that is not JSON the answer
    means nothing, but it is an answer: the parser then says what is wrong."""
    data = (
        document.encode("utf-8", "surrogatepass")
        if isinstance(document, str)
        else document
    )
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # not enough brackets to nest that deep
    if b'\\"' in data:
        # An escaped quote ends no string: drop escaped backslashes first (a
        # string may end in one), then escaped quotes.
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Every quote left opens or closes a string: what lies outside strings is
    # every other piece between them. (UTF-8 never hides these ASCII bytes.)
    outside = b"".join(data.split(b'"')[::2])
    steps = array("b", outside.translate(_STEPS, _NOT_BRACKETS))
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
