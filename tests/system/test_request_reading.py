"""The read stage (recall_site/request_reading.py), fed as a socket would feed
it: a request is whole exactly when its last byte has come, whatever the
pieces; its body is read back by gunicorn's own parser; what the loop must
refuse itself is refused; and the bytes after a request are kept for the next.
"""

from __future__ import annotations

import json

import pytest
from gunicorn.config import Config
from gunicorn.http.errors import InvalidRequestLine

from recall_site.request_reading import (
    MAX_HEAD_BYTES,
    MEMORY_BODY_BYTES,
    Limits,
    Memory,
    Reading,
    Refusal,
    busy,
)

CLIENT = ("127.0.0.1", 40000)


@pytest.fixture
def limits(tmp_path) -> Limits:
    return Limits(1_000_000, 3_000_000, str(tmp_path), Memory(8 * 1024 * 1024))


def _reading(limits: Limits) -> Reading:
    return Reading(Config(), CLIENT, limits, 1)


def _request(body: bytes = b"", *, headers: str = "", method: str = "POST") -> bytes:
    length = f"Content-Length: {len(body)}\r\n" if method == "POST" else ""
    return (
        f"{method} /api/v1/claim HTTP/1.1\r\nHost: x\r\n{length}{headers}\r\n"
    ).encode() + body


def _feed(reading: Reading, data: bytes, step: int) -> list[bool]:
    """Feed ``data`` ``step`` bytes at a time until the request is whole (the
    loop then stops reading into it); what each feed said. The bytes not fed
    are the next request's, after ``reading.leftover``."""
    said = []
    for at in range(0, len(data), step):
        said.append(reading.feed(data[at : at + step]))
        if said[-1]:
            reading.unfed = data[at + step :]
            break
    return said


def _read_back(reading: Reading):
    """The request as the thread gets it: (request, its whole body)."""
    req = next(reading.parser)
    return req, req.body.read()


@pytest.mark.parametrize("step", [1, 7, 4096])
def test_a_request_is_whole_at_its_last_byte_whatever_the_pieces(limits, step):
    body = json.dumps({"wait_seconds": 5, "pad": "y" * 3000}).encode()
    data = _request(body)
    reading = _reading(limits)

    whole = _feed(reading, data, step)

    assert whole[-1] is True and not any(whole[:-1])
    req, read = _read_back(reading)
    assert (req.method, req.path, read) == ("POST", "/api/v1/claim", body)
    assert reading.leftover == b""


def test_a_large_body_waits_on_disk_and_is_read_back_whole(limits, tmp_path):
    body = b"z" * (MEMORY_BODY_BYTES + 12345)
    big = Limits(10 * 1024 * 1024, 0, str(tmp_path), Memory())
    reading = _reading(big)

    assert _feed(reading, _request(body), 1024 * 1024)[-1] is True

    source = reading.parser.source
    assert source.spool is not None  # not in memory
    assert _read_back(reading)[1] == body
    assert big.memory.held == 0  # a spooled body holds none of the budget
    source.close()


def test_a_body_in_memory_holds_the_budget_until_its_request_is_done(limits):
    reading = _reading(limits)
    reading.feed(_request(b"x" * 5000))

    assert limits.memory.held == 5000
    reading.parser.source.close()
    assert limits.memory.held == 0


def test_bytes_after_a_request_are_kept_for_the_next(limits):
    first, second = _request(b"{}"), _request(b'{"wait_seconds": 1}')
    reading = _reading(limits)

    assert reading.feed(first + second) is True

    assert _read_back(reading)[1] == b"{}"
    assert reading.leftover == second


def test_a_chunked_body_is_followed_to_its_end_and_decoded_by_gunicorn(limits):
    chunks = b"5;note=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    data = _request(headers="Transfer-Encoding: chunked\r\n") + chunks
    data = data.replace(b"Content-Length: 0\r\n", b"")
    reading = _reading(limits)

    whole = _feed(reading, data + b"GET /next", 3)

    assert whole[-1] is True and not any(whole[:-1])
    assert _read_back(reading)[1] == b"hello world"
    assert reading.leftover + reading.unfed == b"GET /next"


@pytest.mark.parametrize(
    "chunks",
    [b"zz\r\nab\r\n0\r\n\r\n", b"2\r\nabXY0\r\n\r\n", b"2\n\r\nab\r\n0\r\n\r\n"],
    ids=["not hexadecimal", "no CRLF after the data", "bare LF"],
)
def test_bad_chunked_framing_is_a_400_from_the_loop(limits, chunks):
    data = _request(headers="Transfer-Encoding: chunked\r\n") + chunks
    data = data.replace(b"Content-Length: 0\r\n", b"")
    reading = _reading(limits)

    with pytest.raises(Refusal) as refused:
        reading.feed(data)

    assert refused.value.status == 400
    assert json.loads(refused.value.response().split(b"\r\n\r\n")[1]) == {
        "error": "bad_request",
        "detail": refused.value.detail,
    }


def test_a_chunked_body_past_the_limit_is_a_413_while_it_arrives(limits):
    head = _request(headers="Transfer-Encoding: chunked\r\n")
    head = head.replace(b"Content-Length: 0\r\n", b"")
    reading = _reading(limits)
    reading.feed(head + b"80000\r\n" + b"a" * 100)  # 524,288 bytes: fine
    reading.feed(b"a" * (0x80000 - 100) + b"\r\n")

    with pytest.raises(Refusal) as refused:
        reading.feed(b"80000\r\n")  # past 1,000,000 in all

    assert refused.value.status == 413


def test_a_head_past_64_kib_is_a_431(limits):
    reading = _reading(limits)
    reading.feed(b"GET / HTTP/1.1\r\n")

    with pytest.raises(Refusal) as refused:
        for _ in range(MAX_HEAD_BYTES // 100 + 1):
            reading.feed(b"X-Pad: " + b"p" * 91 + b"\r\n")

    assert refused.value.status == 431


def test_a_head_gunicorn_refuses_goes_to_it_at_once(limits):
    reading = _reading(limits)

    assert reading.feed(b"GET / HTTP/1.1\nHost: x\n") is True  # bare LF: no wait

    with pytest.raises(InvalidRequestLine):
        next(reading.parser)


def test_a_declared_length_past_the_limit_is_not_read_and_closes(limits):
    reading = _reading(limits)
    head = _request(b"").replace(b"Content-Length: 0", b"Content-Length: 5000000")

    assert reading.feed(head + b"abc") is True  # whole: the body is not read

    req, read = _read_back(reading)
    assert (read, req.should_close()) == (b"", True)


def test_a_multipart_upload_may_be_as_large_as_the_form_allows(limits):
    reading = _reading(limits)
    head = _request(b"", headers="Content-Type: multipart/form-data; boundary=b\r\n")
    head = head.replace(b"Content-Length: 0", b"Content-Length: 2000000")

    assert reading.feed(head) is False  # 2 MB: over the API's limit, not the form's
    assert reading.in_body


def test_expect_100_continue_is_answered_by_the_loop_not_the_thread(limits):
    reading = _reading(limits)

    reading.feed(_request(b"").replace(b"Content-Length: 0", b"Content-Length: 2")
                 .replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))  # fmt: skip

    assert reading.send_continue is True
    reading.feed(b"{}")
    req, read = _read_back(reading)
    assert (read, req._expected_100_continue) == (b"{}", False)


def test_an_overloaded_process_answers_the_api_in_json_and_people_with_a_page():
    api, page = busy("/api/v1/claim"), busy("/batches/new/")

    assert api.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nRetry-After: 1\r\n" in api and b"\r\nRetry-After: 1\r\n" in page
    assert json.loads(api.split(b"\r\n\r\n")[1])["error"] == "unavailable"
    assert b"Content-Type: text/html" in page
    assert page.split(b"\r\n\r\n")[1].startswith(b"<!doctype html>")
