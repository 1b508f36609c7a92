"""Numbers from hostile input (query strings, search boxes, JSON bodies), read
so that no value can raise.

Two traps of Python's own: ``str.isdigit`` accepts characters ``int`` refuses
(superscripts such as ``²``, other scripts' digits) and ``int`` refuses digit
strings longer than its limit (4,300 digits, ``sys.get_int_max_str_digits``);
and JSON integers have no size, so ``float`` and ``math.isfinite`` overflow on
one past 1e308 where a comparison would not.
"""

from __future__ import annotations

import math
from typing import TypeGuard

# The largest id a table can hold (a signed 64-bit integer).
MAX_ID = 2**63 - 1


def whole_number(text: str, *, cap: int = MAX_ID + 1) -> int | None:
    """``text`` as a whole number if it is written in ASCII digits only (no
    sign, no spaces, no ``²``), else None. A number larger than ``cap`` is
    ``cap``, whatever its length: callers compare it with their own maximum."""
    if not (text.isascii() and text.isdigit()):
        return None
    significant = text.lstrip("0")
    if len(significant) > len(str(cap)):
        return cap
    return min(int(significant or "0"), cap)


def is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number that compares and stores safely: an integer of any size
    (Python compares them with floats exactly) or a finite float; never a
    boolean, NaN or infinity."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def shown(value: object, limit: int = 40) -> str:
    """``value`` for an error message, cut short: a 4,000-digit number must not
    make a 4,000-character answer (nor, past Python's limit, fail to print)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 3 * limit:
            digits = math.floor(value.bit_length() * math.log10(2)) + 1
            sign = "a negative" if value < 0 else "an"
            return f"{sign} integer of about {digits} digits"
        return str(value)
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}…"
