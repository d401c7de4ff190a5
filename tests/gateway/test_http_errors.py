"""The gateway's refusals over raw HTTP (httpx, real servers): multipart edge cases of ``/v1/audio/transcriptions``
(400 naming the field, 413 over the upload limit with and without a Content-Length), and the JSON routes' 400 /
404 / 405 answers, each in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from helpers.audio_files import wav_bytes

from encdec import DATA_DIR
from encdec.launcher import http_gateway

WHISPER = "whisper-tiny.en"
EMBED = "all-MiniLM-L6-v2"
TRANSCRIBE = "/v1/audio/transcriptions"
WAV = (DATA_DIR / "short.wav").read_bytes()
BIG_WAV = (DATA_DIR / "sample.wav").read_bytes()  # 233 kB: over 0.05 MB + the form overhead (64 KiB)


def error_of(response: httpx.Response, status: int) -> dict:
    """The ``error`` object of an OpenAI-shaped error answer with ``status`` (asserted)."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert body["error"]["type"] in ("invalid_request_error", "authentication_error", "server_error"), body
    return body["error"]


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def small_gateway(stack):
    """A second gateway in front of the same services with a 0.05 MB upload limit."""
    with http_gateway(stack.decoder_addresses, stack.embed_addresses, extra_args=["--max-upload-mb", "0.05"]) as url:
        yield url


AUDIO = ("file", ("short.wav", WAV, "audio/wav"))
MODEL = ("model", (None, WHISPER))
MULTIPART_CASES = {
    "no file": ([MODEL], "file"),
    "empty file": ([("file", ("empty.wav", b"", "audio/wav")), MODEL], "file"),
    "text/plain file": ([("file", ("notes.txt", b"hello there", "text/plain")), MODEL], "file"),
    "text field named file": ([("file", (None, "not a file")), MODEL], "file"),
    "no model": ([AUDIO], "model"),
    "unknown field": ([AUDIO, MODEL, ("speed", (None, "2"))], "speed"),
    "xml format": ([AUDIO, MODEL, ("response_format", (None, "xml"))], "response_format"),
    "negative temperature": ([AUDIO, MODEL, ("temperature", (None, "-0.5"))], "temperature"),
    "temperature not a number": ([AUDIO, MODEL, ("temperature", (None, "abc"))], "temperature"),
}


@pytest.mark.parametrize("parts, field", MULTIPART_CASES.values(), ids=MULTIPART_CASES.keys())
def test_multipart_edge_cases_are_400_naming_the_field(client, parts, field):
    error = error_of(client.post(TRANSCRIBE, files=parts), 400)
    assert error["param"] == field, error
    assert field in error["message"], error
    assert error["type"] == "invalid_request_error", error


def test_a_json_body_on_the_upload_route_is_400_asking_for_multipart(client):
    error = error_of(client.post(TRANSCRIBE, json={"model": WHISPER, "file": "abc"}), 400)
    assert "multipart/form-data" in error["message"] and "file" in error["message"], error


def test_a_non_audio_file_of_audio_type_is_the_decoders_400(client):
    garbage = ("file", ("noise.wav", b"this is not a RIFF file at all " * 64, "audio/wav"))
    error = error_of(client.post(TRANSCRIBE, files=[garbage, MODEL]), 400)
    assert error["type"] == "invalid_request_error" and "audio" in error["message"], error
    assert client.post(TRANSCRIBE, files=[AUDIO, MODEL]).status_code == 200  # and the next one is served


def test_a_float_wav_of_absurd_amplitude_is_400_saying_so(client):
    """A float WAV whose samples reach 1e38 (once decoded to 446 "!" tokens) is the decoder's 400, not a transcript."""
    samples = np.full(16_000, 0.1, np.float32)
    samples[::100] = 1e38
    loud = ("file", ("loud.wav", wav_bytes(samples, subtype="FLOAT"), "audio/wav"))
    error = error_of(client.post(TRANSCRIBE, files=[loud, MODEL]), 400)
    assert error["type"] == "invalid_request_error", error
    assert "reach 1e+38" in error["message"] and "[-1, 1]" in error["message"], error


def _recv_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """The head and the Content-Length body of one HTTP response read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, body
        body += chunk
    return head, body


def test_an_upload_over_the_limit_by_content_length_is_413_before_the_body_is_sent(small_gateway):
    url = urlsplit(small_gateway)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: gateway\r\n"
            b"Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 50000000\r\n\r\n--xyz\r\n"
        )  # 50 MB announced, 7 bytes sent: the answer cannot wait for the body
        head, body = _recv_response(sock)
    assert head.startswith(b"HTTP/1.1 413 "), head
    error = json.loads(body)["error"]
    assert error["param"] == "file" and error["code"] == "file_too_large" and "0.05 MB" in error["message"], error


def test_an_upload_over_the_limit_is_413(small_gateway):
    response = httpx.post(
        small_gateway + TRANSCRIBE, files=[("file", ("sample.wav", BIG_WAV, "audio/wav")), MODEL], timeout=60
    )
    assert "content-length" in response.request.headers
    error = error_of(response, 413)
    assert error["param"] == "file" and error["code"] == "file_too_large", error


def test_a_chunked_upload_over_the_limit_is_413(small_gateway):
    def body():
        yield b'--xyz\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + WHISPER.encode() + b"\r\n"
        yield b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
        for start in range(0, len(BIG_WAV), 16384):
            yield BIG_WAV[start : start + 16384]
        yield b"\r\n--xyz--\r\n"

    response = httpx.post(
        small_gateway + TRANSCRIBE,
        content=body(),
        headers={"content-type": "multipart/form-data; boundary=xyz"},
        timeout=60,
    )
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    error = error_of(response, 413)
    assert error["param"] == "file" and error["code"] == "file_too_large", error


def test_the_small_gateway_serves_a_body_within_the_limit_and_the_form_overhead(small_gateway):
    # short.wav is 83 kB: over 0.05 MB, within it + FORM_OVERHEAD_BYTES (the documented allowance)
    response = httpx.post(small_gateway + TRANSCRIBE, files=[AUDIO, MODEL], timeout=60)
    assert response.status_code == 200 and response.json()["text"], response.text


def test_unknown_json_fields_are_400_naming_them(client, stack):
    error = error_of(client.post("/v1/embeddings", json={"model": EMBED, "input": "hi", "colour": "red"}), 400)
    assert error["param"] == "colour" and "colour" in error["message"], error
    body = {"model": str(stack.t5_path), "prompt": "hi", "max_token": 5}
    error = error_of(client.post("/v1/completions", json=body), 400)
    assert error["param"] == "max_token" and "max_token" in error["message"], error


def test_wrong_json_types_are_400_naming_the_field(client, stack):
    error = error_of(
        client.post("/v1/completions", json={"model": str(stack.t5_path), "prompt": "hi", "n": "two"}), 400
    )
    assert error["param"] == "n", error
    error = error_of(client.post("/v1/embeddings", json={"model": EMBED, "input": 5}), 400)
    assert error["param"] == "input" and "input" in error["message"], error


def test_malformed_json_is_400(client):
    response = client.post(
        "/v1/embeddings", content=b'{"model": "x", "input": ', headers={"content-type": "application/json"}
    )
    error = error_of(response, 400)
    assert "JSON" in error["message"] and error["param"] is None, error


def test_unknown_models_are_404_model_not_found(client):
    for path, body in (
        ("/v1/embeddings", {"model": "no-such-model", "input": "hi"}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
    ):
        error = error_of(client.post(path, json=body), 404)
        assert error["code"] == "model_not_found" and "no-such-model" in error["message"], (path, error)
    response = client.post(TRANSCRIBE, files=[AUDIO, ("model", (None, "no-such-model"))])
    assert error_of(response, 404)["code"] == "model_not_found"
    assert error_of(client.get("/v1/models/no-such-model"), 404)["code"] == "model_not_found"


def test_too_many_embedding_inputs_are_400_naming_the_limit(client):
    error = error_of(client.post("/v1/embeddings", json={"model": EMBED, "input": ["a few words"] * 10_000}), 400)
    assert error["param"] == "input" and "2048" in error["message"] and "10000" in error["message"], error
    after = client.post("/v1/embeddings", json={"model": EMBED, "input": ["still answering"]})
    assert after.status_code == 200 and len(after.json()["data"]) == 1, after.text


def test_an_empty_input_list_is_400(client):
    error = error_of(client.post("/v1/embeddings", json={"model": EMBED, "input": []}), 400)
    assert error["param"] == "input", error


def test_a_get_on_a_post_route_is_405_in_openai_shape(client):
    response = client.get("/v1/embeddings")
    error = error_of(response, 405)
    assert error["type"] == "invalid_request_error", error
    assert "POST" in response.headers.get("allow", ""), response.headers


def test_an_unknown_path_is_404_in_openai_shape(client):
    error = error_of(client.get("/v1/no/such/route"), 404)
    assert error["type"] == "invalid_request_error", error
    error_of(client.post("/v2/completions", json={}), 404)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": EMBED, "input": "x", "dimensions": 2**32}, "dimensions"),
        ("/v1/embeddings", {"model": EMBED, "input": [2**31]}, "input"),
        ("/v1/embeddings", {"model": EMBED, "input": "x", "dimensions": "3"}, "dimensions"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 10**14}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "seed": 2**63}, "seed"),  # proto: [0, 2**63 - 1]
        ("/v1/rerank", {"model": EMBED, "query": "q", "documents": ["d"], "top_n": 10**20}, "top_n"),
        ("/v1/embeddings", {"model": "", "input": "x"}, "model"),
        ("/v1/embeddings", {"model": "m" * 20000, "input": "x"}, "model"),
    ],
)
def test_out_of_range_and_uncoerced_values_are_400_naming_the_field(stack, path, body, param):
    response = httpx.post(stack.url + path, json=body, timeout=30)
    error = error_of(response, 400)
    assert error["param"] == param, error


def test_a_token_id_out_of_range_is_400_saying_so_not_that_a_string_was_expected(client):
    """Issue 34 break test: ``[[99999999999]]`` got "input: Input should be a valid string" (the first member of the
    union ``str | list[str] | list[int] | list[list[int]]``), though the input is token ids, one out of range."""
    for body, where in (([[99999999999]], "input[0][0]"), ([7, 2**31], "input[1]")):
        error = error_of(client.post("/v1/embeddings", json={"model": EMBED, "input": body}), 400)
        assert error["param"] == "input", error
        assert error["message"].startswith(where) and "2147483647" in error["message"], error
    error = error_of(client.post("/v1/embeddings", json={"model": EMBED, "input": {"a": 1}}), 400)
    assert error["param"] == "input" and "valid string" in error["message"], error  # no member got further


@pytest.mark.parametrize("field", ["input", "model"])
def test_a_lone_surrogate_is_400_not_a_500(stack, field):
    model, text = (EMBED, "\\ud800") if field == "input" else ("\\ud800", "x")
    body = '{"model": "' + model + '", "input": "' + text + '"}'  # JSON's escape, not a Python character
    response = httpx.post(
        stack.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    error = error_of(response, 400)  # pydantic's JSON parser already refuses it as JSON, or names the field
    assert error["param"] in (field, None) and "internal error" not in error["message"], error
    # once "the body is not valid JSON: Invalid JSON: unexpected end of hex escape at line 1 column ..."
    assert error["message"].startswith("the request body is not valid JSON: a string holds a lone UTF-16 surrogate")
    assert "send UTF-8 text" in error["message"] and "hex escape" not in error["message"], error


def test_a_multipart_body_cut_before_its_closing_boundary_says_so(client):
    """A body cut in transit was read as a form without its last part: "missing required field 'file'"."""
    whole = httpx.Request("POST", client.base_url.join(TRANSCRIBE), files=[MODEL, AUDIO])
    body, content_type = whole.read(), whole.headers["content-type"]
    for cut in (len(body) - 8, len(body) // 2, 40):  # in the closing boundary, in the file, in the first part
        response = client.post(TRANSCRIBE, content=body[:cut], headers={"content-type": content_type})
        error = error_of(response, 400)
        assert "ended before its closing boundary" in error["message"], (cut, error)
        assert "send the whole upload" in error["message"], (cut, error)
    response = client.post(TRANSCRIBE, content=body + b"an epilogue", headers={"content-type": content_type})
    assert response.status_code == 200, response.text  # RFC 2046 5.1.1: text after the closing boundary is ignored


def test_a_json_body_over_the_limit_is_413_before_it_is_read(stack):
    with http_gateway(stack.decoder_addresses, stack.embed_addresses, ["--max-request-mb", "0.01"]) as url:
        big = {"model": EMBED, "input": ["word " * 100] * 40}  # ~20 KB
        error = error_of(httpx.post(url + "/v1/embeddings", json=big, timeout=30), 413)
        assert "--max-request-mb" in error["message"], error
        small = httpx.post(url + "/v1/embeddings", json={"model": EMBED, "input": "x"}, timeout=30)
        assert small.status_code == 200, small.text
        body = json.dumps({"model": EMBED, "query": "q", "documents": ["word " * 100] * 40}).encode()
        for path in ("/v1/embeddings", "/v1/rerank"):  # chunked: no Content-Length to refuse it by
            payload = body if path == "/v1/rerank" else json.dumps(big).encode()
            chunks = (payload[i : i + 4096] for i in range(0, len(payload), 4096))
            response = httpx.post(url + path, content=chunks, headers={"content-type": "application/json"}, timeout=30)
            assert "--max-request-mb" in error_of(response, 413)["message"], path


def test_head_health_and_stream_options_without_stream(stack):
    assert httpx.head(stack.url + "/health", timeout=30).status_code == 200
    body = {"model": "m", "prompt": "hi", "stream_options": {"include_usage": True}}
    error = error_of(httpx.post(stack.url + "/v1/completions", json=body, timeout=30), 400)
    assert error["param"] == "stream_options", error


def test_a_text_endpoint_with_only_speech_backends_is_404_not_503(stack):
    with http_gateway([stack.whisper.decoder_address]) as url:
        response = httpx.post(url + "/v1/completions", json={"model": "/models/my-t5", "prompt": "hi"}, timeout=30)
        error = error_of(response, 404)
        assert error["code"] == "model_not_found" and WHISPER in error["message"], error


def test_json_without_its_content_type_says_so(stack):
    response = httpx.post(  # what `curl -d '{...}'` sends without -H 'content-type: application/json'
        stack.url + "/v1/embeddings",
        content=b'{"model": "m", "input": "x"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    error = error_of(response, 400)
    assert "Content-Type: application/json" in error["message"], error


def test_an_unexpected_gateway_error_is_a_stable_500_with_the_request_id(caplog):
    """Issue 34 item 8: an exception in the gateway once answered "internal error: RuntimeError: <its text>"; now
    the text is logged with the request id, which the client gets in the message and ``X-Request-Id``."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gateway_svc import errors

    app = FastAPI()
    errors.install(app)
    app.add_middleware(errors.RequestIdMiddleware)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("redis://10.9.8.7:6379 refused")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    rid = response.headers["x-request-id"]
    assert error_of(response, 500)["message"] == f"{errors.INTERNAL_MESSAGE} (request id {rid})"
    assert "10.9.8.7" not in response.text and "RuntimeError" not in response.text, response.text
    logged = [r for r in caplog.records if rid in r.getMessage() and r.exc_info]
    assert logged and "10.9.8.7" in str(logged[0].exc_info[1]), caplog.text
