"""The gateway's streams over raw HTTP (httpx, real servers): server-sent-event framing of ``/v1/completions`` and
``/v1/audio/transcriptions``, and a client that goes away (a closed stream, a client timeout) ending the decoder's
request: nothing left running, every KV block free again, the request's record ABORTED.
"""

from __future__ import annotations

import json
import socket
import time

import grpc
import httpx
import pytest
import redis

from encdec import DATA_DIR
from shared.proto import decoder_pb2, decoder_pb2_grpc

WHISPER = "whisper-tiny.en"
# The tiny T5's 256 positions: 255 new tokens at most (max_tokens above that is capped, not refused).
T5_MAX_NEW_TOKENS = 255
PROMPT = "the quick dog runs over the old bridge near the river"


def sse_payloads(response: httpx.Response) -> list[str]:
    """The ``data`` of each event of an SSE body, checking that every event is exactly ``data: <payload>\\n\\n``."""
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    body = response.text
    assert body.endswith("\n\n"), body[-200:]
    payloads = []
    for event in body[:-2].split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event and "\r" not in event, repr(event)
        payloads.append(event[len("data: ") :])
    return payloads


def long_unique_clip() -> bytes:
    """~75 s of the bundled clips in a row (three 30 s windows) with a little fresh noise: seconds of work that no
    earlier request's encoder-cache entry can shorten, so the client always leaves before it ends."""
    import io

    import numpy as np
    import soundfile

    clips = [soundfile.read(path, dtype="float32") for path in sorted(DATA_DIR.glob("*.wav"))]
    rate = clips[0][1]
    pcm = np.concatenate([c for c, _ in clips] * 3)[: 75 * rate]
    pcm = pcm + np.random.default_rng().normal(0.0, 1e-4, pcm.shape).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, pcm, rate, format="WAV", subtype="FLOAT")
    return out.getvalue()


def _stub(address: str):
    channel = grpc.insecure_channel(address)
    return channel, decoder_pb2_grpc.DecoderServiceStub(channel)


@pytest.fixture(scope="module")
def t5_stub(stack):
    channel, stub = _stub(stack.t5.decoder_address)
    with channel:
        yield stub


@pytest.fixture(scope="module")
def whisper_stub(stack):
    channel, stub = _stub(stack.whisper.decoder_address)
    with channel:
        yield stub


def wait_idle(stub, timeout_s: float = 10.0) -> decoder_pb2.DecoderStats:
    """The decoder's stats once nothing runs, waits or queues and every self / cross block is free (asserted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stub.GetStats(decoder_pb2.GetStatsRequest())
        idle = s.num_running == 0 and s.num_waiting == 0 and s.num_queued_requests == 0
        free = s.num_free_self_blocks == s.num_self_blocks and s.num_free_cross_blocks == s.num_cross_blocks
        if (idle and free) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle and free, s
    return s


def records_since(redis_url: str, model: str, since: float) -> list[dict]:
    """The Redis request records (``decoder_svc.replicas.request_state``) of ``model`` created at or after ``since``."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        records = [client.hgetall(key) for key in client.scan_iter(match="*:request:*", count=1000)]
    finally:
        client.close()
    return [r for r in records if r.get("model") == model and float(r.get("created_at") or 0) >= since]


def wait_record(redis_url: str, model: str, since: float, state: str, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = records_since(redis_url, model, since)
        if any(r.get("state") == state for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_completion_stream_is_sse_framed_and_ends_with_done(stack):
    body = {"model": str(stack.t5_path), "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        whole = client.post("/v1/completions", json=body)
        streamed = client.post(
            "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert whole.status_code == 200, whole.text
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers.get("cache-control") == "no-cache"
    payloads = sse_payloads(streamed)
    assert payloads[-1] == "[DONE]"
    assert payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) >= 2, payloads
    *texts, usage = chunks
    for chunk in texts:
        assert chunk["object"] == "text_completion" and chunk["model"] == str(stack.t5_path), chunk
        assert len(chunk["choices"]) == 1 and chunk["choices"][0]["index"] == 0, chunk
    assert len({c["id"] for c in chunks}) == 1, "every chunk of one completion has its id"
    assert texts[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in texts[:-1])
    expected = whole.json()["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in texts) == expected["text"]
    assert usage["choices"] == [] and usage["usage"] == whole.json()["usage"], usage


def test_transcription_stream_has_deltas_then_one_done_and_no_done_marker(stack):
    audio = (DATA_DIR / "sample.wav").read_bytes()
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        whole = client.post(
            "/v1/audio/transcriptions", files={"file": ("sample.wav", audio, "audio/wav")}, data={"model": WHISPER}
        )
        streamed = client.post(
            "/v1/audio/transcriptions",
            files={"file": ("sample.wav", audio, "audio/wav")},
            data={"model": WHISPER, "stream": "true"},
        )
    assert whole.status_code == 200, whole.text
    assert streamed.status_code == 200, streamed.text
    payloads = sse_payloads(streamed)
    assert "[DONE]" not in payloads, "OpenAI's transcription stream has no [DONE] marker"
    events = [json.loads(p) for p in payloads]
    *deltas, done = events
    assert deltas and all(e["type"] == "transcript.text.delta" and e["delta"] for e in deltas), events
    assert done["type"] == "transcript.text.done", events
    assert done["text"] == "".join(e["delta"] for e in deltas).strip() == whole.json()["text"]
    assert done["usage"]["type"] == "tokens" and done["usage"]["output_tokens"] > 0, done
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def test_closing_a_completion_stream_aborts_the_decoder_request(stack, t5_stub, redis_url):
    baseline = wait_idle(t5_stub)
    model = str(stack.t5_path)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    since = time.time() - 0.5
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: an iterator dropped unfinished closes the connection at once
            first = next(lines)
            assert first.startswith("data: {"), first
            during = t5_stub.GetStats(decoder_pb2.GetStatsRequest())
        # leaving the block closes the response unread: httpx drops the connection
    assert during.num_running + during.num_waiting == 1, during
    assert during.num_free_self_blocks < baseline.num_free_self_blocks, during
    after = wait_idle(t5_stub)
    assert after.num_free_self_blocks == baseline.num_free_self_blocks
    assert after.num_free_cross_blocks == baseline.num_free_cross_blocks
    records = wait_record(redis_url, model, since, "ABORTED")
    assert [r["state"] for r in records] == ["ABORTED"], records
    record = t5_stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=records[0]["request_id"]))
    assert record.finish_reason == "abort", record
    assert 0 < record.completion_tokens < T5_MAX_NEW_TOKENS, record


def test_a_transcription_client_that_times_out_leaves_nothing_running(stack, whisper_stub, redis_url):
    wait_idle(whisper_stub)
    audio = (DATA_DIR / "sample.wav").read_bytes()
    since = time.time() - 0.5
    # The request over a raw socket, closed (as a client's timeout closes it) once the decoder has the request: a fixed
    # short client timeout could fire while the gateway still reads the upload, before any request exists.
    request = httpx.Request(
        "POST",
        f"{stack.url}/v1/audio/transcriptions",
        files={"file": ("long.wav", long_unique_clip(), "audio/wav")},
        data={"model": WHISPER},
    )
    url = httpx.URL(stack.url)
    head = f"POST {request.url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in request.headers.items() if k.lower() != "host"
    )
    earlier = {r["request_id"] for r in records_since(redis_url, WHISPER, since)}  # e.g. the previous test's

    def ours() -> list[dict]:
        return [r for r in records_since(redis_url, WHISPER, since) if r["request_id"] not in earlier]

    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + request.read())
        deadline = time.monotonic() + 30
        while not ours() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ours(), "the decoder never got the request"
    wait_idle(whisper_stub)
    deadline = time.monotonic() + 10
    while ours()[0]["state"] != "ABORTED" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r["state"] for r in ours()] == ["ABORTED"], ours()
    with httpx.Client(base_url=stack.url, timeout=60) as client:  # and the gateway serves the next one
        again = client.post(
            "/v1/audio/transcriptions", files={"file": ("sample.wav", audio, "audio/wav")}, data={"model": WHISPER}
        )
    assert again.status_code == 200 and again.json()["text"], again.text
