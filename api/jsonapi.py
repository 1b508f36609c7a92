"""JSON API plumbing shared by the worker API (``api.worker_views``) and the operator
API (``api.operator_views``): one error shape, ``{"error": <code>, "detail":
<sentence>}``, and one careful reading of a JSON body (size limit, UTF-8, at
most ``MAX_JSON_DEPTH`` levels of nesting, no NUL, no lone surrogates, finite
numbers). Bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse

from batches.json_limits import MAX_JSON_DEPTH, nested_deeper_than


class ApiError(Exception):
    """An error answer: raise it anywhere in a view; the endpoint decorator
    renders it. ``extra`` adds fields beside error and detail (the operator
    API's list of invalid items)."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        headers: dict | None = None,
        extra: dict | None = None,
    ):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail
        self.headers, self.extra = headers or {}, extra or {}

    def response(self) -> JsonResponse:
        return error_response(
            self.status, self.code, self.detail, self.headers, self.extra
        )


def error_response(
    status: int,
    code: str,
    detail: str,
    headers: dict | None = None,
    extra: dict | None = None,
) -> JsonResponse:
    response = JsonResponse(
        {"error": code, "detail": detail, **(extra or {})}, status=status
    )
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def bad_request(detail: str) -> ApiError:
    return ApiError(400, "bad_request", detail)


def json_object_body(request: HttpRequest) -> dict:
    """The body as a JSON object ({} when empty), free of NUL and lone surrogates."""
    try:
        raw = request.body
    except RequestDataTooBig:
        raise ApiError(
            413,
            "payload_too_large",
            f"The body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.",
        ) from None
    if not raw:
        # No body at all is {}; whitespace alone is not JSON (its schema
        # says so, and a body that is there must be an object).
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The body is not valid UTF-8.") from None
    # Before parsing: the parser recurses once per level, and so does every
    # later reader of what is stored (pages, exports, the database adapter).
    if nested_deeper_than(raw, MAX_JSON_DEPTH):
        raise bad_request(
            f"The body is nested too deeply: at most {MAX_JSON_DEPTH} levels of "
            f"arrays and objects within each other."
        )
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
    except ValueError as error:
        raise bad_request(f"The body is not valid JSON: {error}.") from None
    if not isinstance(data, dict):
        raise bad_request(f"The body must be a JSON object, not {json_type(data)}.")
    _check_values(data)
    return data


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _parse_int(digits: str) -> int:
    """An integer of the body; one longer than Python converts (4,300 digits
    by default) is refused in words a client understands."""
    try:
        return int(digits)
    except ValueError:
        raise ValueError(
            f"a number has {len(digits.lstrip('-'))} digits, more than the "
            f"{sys.get_int_max_str_digits()} allowed"
        ) from None


def _check_values(data: Any) -> None:
    """Refuse NUL characters, unpaired surrogates and numbers too large to be
    finite (``1e400`` parses as infinity) anywhere in the document: the database
    cannot store them."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad_request("Numbers must be finite (this one overflows).")
        elif isinstance(value, str):
            if "\x00" in value:
                raise bad_request("Strings must not contain NUL (\\u0000) characters.")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(
                    "Strings must not contain unpaired surrogates."
                ) from None


def json_type(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def field(
    body: dict, name: str, kind: type, *, required: bool = True, default: Any = None
):
    if name not in body:
        if required:
            raise bad_request(f"Missing field {name!r}.")
        return default
    value = body[name]
    # bool is an int in Python: never accept one for the other.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = {
            str: "a string",
            bool: "a boolean",
            dict: "an object",
            list: "an array",
            int: "an integer",
        }[kind]
        raise bad_request(f"Field {name!r} must be {expected}, not {json_type(value)}.")
    return value
