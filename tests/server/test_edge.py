"""The edge (server/edge.py) against a real server, where a review found it read a request
otherwise than the routes do (issue 51, E1-E3): headers a body is read by given twice, compressed
bodies not consumed whole, raw deflate refused, and no deadline on reading a body."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
import zlib
from urllib.parse import urlsplit

import httpx
import pytest
import zstandard

from conftest import API_KEY, SMALL_BODY_TIMEOUT_S

BODY = json.dumps({"model": "agentkv-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                   "context_management": {"edits": []}}).encode()


def post(server, content: bytes, headers: list[tuple[str, str]]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", content=content, timeout=120,
                      headers=[("authorization", f"Bearer {API_KEY}"), *headers])


@pytest.mark.parametrize("name,values", [
    ("content-type", ("application/json", "text/plain")),
    ("content-encoding", ("identity", "gzip")),
])
def test_a_header_the_body_is_read_by_given_twice_is_a_400(small_server, name, values):
    """The edge read the last ``Content-Type``, FastAPI the first: the body went to Python's json
    (NaN, 1e400 and lone surrogates accepted; a lone surrogate then failed as a 500)."""
    body = BODY.replace(b'"hi"', b'"\\ud800"')
    r = post(small_server, body, [("content-type", "application/json"), *[(name, v) for v in values[1:]]]
             if name == "content-type" else [("content-type", "application/json"), *[(name, v) for v in values]])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and "more than once" in err["message"]


def test_content_length_twice_is_a_400(small_server):
    """Sent by hand: httpx sets Content-Length itself."""
    url = urlsplit(small_server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(BODY)}\r\n"
                    f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n".encode() + BODY)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


REFUSED = {
    "two gzip members": ("gzip", gzip.compress(BODY) + gzip.compress(b" ")),
    "gzip and trailing bytes": ("gzip", gzip.compress(BODY) + b"junk"),
    "a gzip member cut short": ("gzip", gzip.compress(BODY)[:-6]),
    "a zstd frame cut short": ("zstd", _zstd(BODY)[:-4]),
    "zstd and trailing bytes": ("zstd", _zstd(BODY) + b"junk"),
    "deflate and trailing bytes": ("deflate", zlib.compress(BODY) + b"junk"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_compressed_body_is_one_whole_body_or_a_400(small_server, case):
    """Before: a second gzip member or trailing bytes were ignored, and a zstd frame cut short read
    as an empty body (a 422 of the route, not a 400 of the encoding)."""
    encoding, content = REFUSED[case]
    r = post(small_server, content, [("content-type", "application/json"), ("content-encoding", encoding)])
    assert r.status_code == 400, (case, r.status_code, r.text)
    assert r.json()["error"]["code"] == "invalid_encoding", r.text


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


ACCEPTED = {
    "zlib-wrapped deflate (RFC 1950)": ("deflate", zlib.compress(BODY)),
    "raw deflate (RFC 1951)": ("deflate", _raw_deflate(BODY)),
    "gzip": ("gzip", gzip.compress(BODY)),
    "zstd in two frames": ("zstd", _zstd(BODY[:40]) + _zstd(BODY[40:])),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_whole_compressed_bodies_are_read(small_server, case):
    encoding, content = ACCEPTED[case]
    r = post(small_server, content, [("content-type", "application/json"), ("content-encoding", encoding)])
    assert r.status_code == 200, (case, r.text)


def test_a_body_that_never_arrives_is_a_408_within_the_deadline(small_server):
    """A key holder that sends the headers and part of a body, then nothing: the connection is
    answered 408 once ``--body-timeout-s`` has passed, not parked forever (issue 51, E3)."""
    url = urlsplit(small_server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=SMALL_BODY_TIMEOUT_S + 60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])
        t0 = time.monotonic()
        reply = s.recv(65536)
        waited = time.monotonic() - t0
        while chunk := s.recv(65536):               # then the server closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert SMALL_BODY_TIMEOUT_S - 1 <= waited <= SMALL_BODY_TIMEOUT_S + 30
    assert b"connection: close" in reply.lower() and b"request_timeout" in reply


# The sign-in form, in process (server/edge.py alone): anyone may POST /ui/login, so the edge reads
# only a few KiB of it and inflates none of it (before: the API's 32 MiB, gzip and zstd included).

def _login(content: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, int]:
    """(status, error, body bytes the edge took) for ``content`` posted to /ui/login in chunks."""
    from agentkv.server.edge import Edge
    from agentkv.server.ui_auth import UICookie

    taken, sent, seen = [0], [], []

    async def form(scope, receive, send):                       # the route: reads what the edge passes on
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        chunk = content.pop(0)
        taken[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(content)}

    async def send(message):
        sent.append(message)

    edge = Edge(form, 32 * 2**20, keys=(API_KEY,), ui=UICookie(b"s" * 32, ()))
    scope = {"type": "http", "method": "POST", "path": "/ui/login",
             "headers": [(b"content-type", b"application/x-www-form-urlencoded"), *headers]}
    asyncio.run(edge(scope, receive, send))
    status = sent[0]["status"]
    return status, (json.loads(sent[1]["body"])["error"] if status != 200 else {"body": seen[0]}), taken[0]


def test_the_sign_in_form_is_read_as_sent():
    status, got, _ = _login([b"key=", API_KEY.encode()], [])
    assert status == 200 and got["body"] == b"key=" + API_KEY.encode()


def test_a_sign_in_form_over_a_few_kib_is_a_413_read_no_further():
    from agentkv.server.edge import LOGIN_MAX_BYTES

    chunks = [b"k" * 65536 for _ in range(512)]                 # 32 MiB, chunked: no Content-Length
    status, err, taken = _login(chunks, [])
    assert status == 413 and err["code"] == "request_too_large" and str(LOGIN_MAX_BYTES) in err["message"]
    assert taken <= 65536                                       # one chunk, not 32 MiB
    status, err, taken = _login([b"k" * 10], [(b"content-length", str(32 * 2**20).encode())])
    assert status == 413 and taken == 0                         # declared too large: nothing read


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate", b"zstd", b"br"])
def test_a_compressed_sign_in_form_is_a_415_unread(encoding):
    status, err, taken = _login([gzip.compress(b"key=" + b"0" * (8 << 20))], [(b"content-encoding", encoding)])
    assert status == 415 and err["code"] == "unsupported_encoding" and taken == 0
