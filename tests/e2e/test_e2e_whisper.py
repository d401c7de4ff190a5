"""End to end: Redis + encoder_svc + decoder_svc as separate processes, real gRPC.

Transcripts are compared with HF transformers' greedy ``generate`` on the same
(CTranslate2) weights, so requests name HF's decoding rules (``HF_RULES``: a short
clip is one window streamed token by token); Redis records and KV block counts are
read back from the real services.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from helpers.audio_files import wav_bytes

from encdec import DATA_DIR
from shared.models.registry import resolve_model
from shared.models.whisper_features import load_tokenizer
from shared.proto import decoder_pb2

DATA = DATA_DIR
CLIPS = ["sample.wav", "numbers.wav", "short.wav"]
HF_RULES = decoder_pb2.WhisperOptions(decoding_rules="hf")


@pytest.fixture(scope="module")
def services(tiny_services):
    return tiny_services  # the session's tiny.en stack (tests/conftest.py)


@pytest.fixture(scope="module")
def stub(tiny_stub):
    return tiny_stub


@pytest.fixture(scope="module")
def hf_tokens(hf_whisper_tokens):
    """HF greedy token ids (no prompt, no end token) for each clip (see conftest)."""
    return hf_whisper_tokens


def generate(stub, audio: bytes, request_id: str = "", **sampling):
    request = decoder_pb2.GenerateRequest(
        request_id=request_id, audio=audio, sampling=decoder_pb2.SamplingParams(**sampling), whisper=HF_RULES
    )
    return list(stub.Generate(request, timeout=120))


def assert_all_blocks_free(stub, timeout_s: float = 10.0) -> decoder_pb2.DecoderStats:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.GetStats(decoder_pb2.GetStatsRequest())
        free = (
            stats.num_free_self_blocks == stats.num_self_blocks
            and stats.num_free_cross_blocks == stats.num_cross_blocks
        )
        if (free and stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stats.num_free_self_blocks == stats.num_self_blocks, stats
    assert stats.num_free_cross_blocks == stats.num_cross_blocks, stats
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    return stats


def wait_state(stub, request_id: str, state: int, timeout_s: float = 10.0) -> decoder_pb2.RequestRecord:
    deadline = time.monotonic() + timeout_s
    while True:
        record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
        if record.state == state or time.monotonic() > deadline:
            assert record.state == state, record
            return record
        time.sleep(0.1)


def test_concurrent_clips_match_hf_and_finish_in_redis(stub, hf_tokens):
    tokenizer = load_tokenizer(resolve_model("whisper-tiny.en")[1])
    ids = {name: f"e2e-{name}-{uuid.uuid4().hex[:8]}" for name in CLIPS}
    with ThreadPoolExecutor(len(CLIPS)) as pool:
        futures = {name: pool.submit(generate, stub, (DATA / name).read_bytes(), ids[name]) for name in CLIPS}
        results = {name: f.result() for name, f in futures.items()}
    for name, messages in results.items():
        tokens = [t for m in messages for t in m.token_ids]
        final = messages[-1]
        assert final.finish_reason == decoder_pb2.FINISH_REASON_STOP
        assert tokens[-1] == 50256  # the end token is reported, never shown as text
        assert tokens[:-1] == hf_tokens[name], name
        streamed = "".join(m.text for m in messages)
        assert streamed == tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(streamed.strip()) > 5
        assert final.usage.completion_tokens == len(tokens)
        assert final.usage.prompt_tokens == 2 and final.usage.encoder_tokens == 1500
        assert all(m.request_id == ids[name] for m in messages)
        record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=ids[name]))
        assert record.state == decoder_pb2.REQUEST_STATE_FINISHED
        assert record.completion_tokens == len(tokens) and record.prompt_tokens == 2
        assert record.finish_reason == "stop" and record.model == "whisper-tiny.en"
        assert record.created_at <= record.updated_at
    assert_all_blocks_free(stub)


def test_get_stats_names_the_served_audio_model(stub):
    stats = stub.GetStats(decoder_pb2.GetStatsRequest())
    assert stats.model == "whisper-tiny.en" and stats.input_kind == "audio", stats
    directory = str(resolve_model("whisper-tiny.en")[1])
    assert list(stats.served_model_names) == sorted({"whisper-tiny.en", "openai/whisper-tiny.en", directory})
    audio = (DATA / "short.wav").read_bytes()
    for name in stats.served_model_names:  # every name it reports is one Generate accepts
        request = decoder_pb2.GenerateRequest(
            model=name, audio=audio, sampling=decoder_pb2.SamplingParams(max_tokens=2)
        )
        assert len([t for m in stub.Generate(request, timeout=120) for t in m.token_ids]) == 2, name


BAD_INPUTS = {
    "undecodable audio": (dict(audio=b"this is not audio at all" * 10), grpc.StatusCode.INVALID_ARGUMENT, "audio"),
    "empty audio": (
        dict(audio=wav_bytes(np.zeros(0, dtype=np.float32))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "no samples",
    ),
    "no input": (dict(), grpc.StatusCode.INVALID_ARGUMENT, "no input"),
    "too long": (
        dict(pcm=decoder_pb2.PcmAudio(samples=np.zeros(1000 * 601, "<f4").tobytes(), sample_rate=1000)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "the maximum is 600.00s",
    ),
    "odd pcm bytes": (
        dict(pcm=decoder_pb2.PcmAudio(samples=b"\0" * 7, sample_rate=16000)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "",
    ),
    "unknown model": (dict(model="whisper-huge-v9"), grpc.StatusCode.NOT_FOUND, "whisper-huge-v9"),
    "negative temperature": (
        dict(sampling=decoder_pb2.SamplingParams(temperature=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    "top_p zero": (dict(sampling=decoder_pb2.SamplingParams(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "negative top_k": (dict(sampling=decoder_pb2.SamplingParams(top_k=-3)), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    "zero max_tokens": (
        dict(sampling=decoder_pb2.SamplingParams(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens",
    ),
    # Issue 34 item 5: -2^31 displaced other users' queued requests and won preemption; the floor is 0 by default.
    "urgent priority": (dict(priority=-(2**31)), grpc.StatusCode.INVALID_ARGUMENT, "(--min-client-priority)"),
    "slightly urgent priority": (dict(priority=-1), grpc.StatusCode.INVALID_ARGUMENT, "lowest accepted is 0"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_status_and_service_keeps_serving(stub, case):
    fields, code, needle = BAD_INPUTS[case]
    good_audio = (DATA / "short.wav").read_bytes()
    if "audio" not in fields and "pcm" not in fields and case != "no input":
        fields = {**fields, "audio": good_audio}
    request_id = f"bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(decoder_pb2.GenerateRequest(request_id=request_id, **fields), timeout=60))
    assert info.value.code() == code, info.value.details()
    assert needle in info.value.details()
    with pytest.raises(grpc.RpcError) as missing:  # no Redis record left behind
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    messages = generate(stub, good_audio, max_tokens=3)
    assert messages[-1].finish_reason in (decoder_pb2.FINISH_REASON_LENGTH, decoder_pb2.FINISH_REASON_STOP)
    assert_all_blocks_free(stub)


def test_max_tokens_gives_length(stub, hf_tokens):
    messages = generate(stub, (DATA / "sample.wav").read_bytes(), max_tokens=4)
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == hf_tokens["sample.wav"][:4]
    assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 4


def test_seeded_sampling_is_reproducible(stub):
    audio = (DATA / "numbers.wav").read_bytes()
    runs = [generate(stub, audio, temperature=1.0, top_k=50, top_p=0.95, seed=1234, max_tokens=12) for _ in range(2)]
    tokens = [[t for m in msgs for t in m.token_ids] for msgs in runs]
    assert tokens[0] == tokens[1]


def test_duplicate_request_id_is_refused(stub):
    request_id = f"dup-{uuid.uuid4().hex[:8]}"
    generate(stub, (DATA / "short.wav").read_bytes(), request_id, max_tokens=2)
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, (DATA / "short.wav").read_bytes(), request_id, max_tokens=2)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert (
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id)).state
        == decoder_pb2.REQUEST_STATE_FINISHED
    )


def test_client_disconnect_aborts_and_frees_blocks(stub):
    request_id = f"cancel-{uuid.uuid4().hex[:8]}"
    call = stub.Generate(
        decoder_pb2.GenerateRequest(request_id=request_id, audio=(DATA / "sample.wav").read_bytes(), whisper=HF_RULES),
        timeout=120,
    )
    first = next(call)
    assert first.token_ids
    call.cancel()
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_ABORTED)
    assert record.finish_reason == "abort"
    assert_all_blocks_free(stub)


def test_abort_rpc_ends_stream(stub):
    request_id = f"abort-{uuid.uuid4().hex[:8]}"
    call = stub.Generate(
        decoder_pb2.GenerateRequest(request_id=request_id, audio=(DATA / "sample.wav").read_bytes(), whisper=HF_RULES),
        timeout=120,
    )
    next(call)
    assert stub.Abort(decoder_pb2.AbortRequest(request_id=request_id)).aborted
    rest = list(call)
    assert rest[-1].finish_reason == decoder_pb2.FINISH_REASON_ABORT
    streamed = 1 + sum(len(m.token_ids) for m in rest)
    assert rest[-1].usage.completion_tokens == streamed and rest[-1].usage.prompt_tokens == 2
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_ABORTED)
    assert record.completion_tokens == streamed and record.prompt_tokens == 2
    assert not stub.Abort(decoder_pb2.AbortRequest(request_id=request_id)).aborted
    assert_all_blocks_free(stub)


def test_unknown_request_id_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id="never-seen"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_overflowing_temperature_never_fails_a_companion(stub, hf_tokens):
    """temperature=1e-45 samples greedily; the greedy request decoding beside it is unharmed."""
    audio = (DATA / "sample.wav").read_bytes()
    with ThreadPoolExecutor(2) as pool:
        victim = pool.submit(generate, stub, audio)
        time.sleep(1.0)
        tiny = pool.submit(generate, stub, (DATA / "short.wav").read_bytes(), temperature=1e-45)
        tiny_tokens = [t for m in tiny.result() for t in m.token_ids]
        victim_tokens = [t for m in victim.result() for t in m.token_ids]
    assert victim_tokens[:-1] == hf_tokens["sample.wav"]
    assert tiny_tokens[:-1] == hf_tokens["short.wav"]


def test_over_long_request_id_is_refused(stub):
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, (DATA / "short.wav").read_bytes(), "x" * 5000, max_tokens=1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 256" in info.value.details()
    # Issue 34 item 7: GetRequest and Abort bound ids too (a Redis key of any size before), and no id may carry a
    # character that is not printable (a newline forged log lines).
    for call in (stub.GetRequest, stub.Abort):
        request = decoder_pb2.GetRequestRequest if call is stub.GetRequest else decoder_pb2.AbortRequest
        for bad, words in (("y" * 100_000, "limit is 256"), ("id\nFAKE LOG LINE", "not printable at position 2")):
            with pytest.raises(grpc.RpcError) as info:
                call(request(request_id=bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
            assert len(info.value.details()) < 400
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, (DATA / "short.wav").read_bytes(), "a\tb", max_tokens=1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not printable" in info.value.details()


@pytest.mark.parametrize(
    "shape,segment,code",
    [
        ([4, 2, 100, 0, 6, 64], None, grpc.StatusCode.INVALID_ARGUMENT),
        ([4, 2, -5, 16, 6, 64], None, grpc.StatusCode.INVALID_ARGUMENT),
        ([4, 2, 100, 16, 6, 64], "encdec-kv-../../etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
        ([4, 2, 100, 16, 6, 64], "encdec-kv-0123456789abcdef", grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_encode_rejects_malformed_targets(services, stub, shape, segment, code):
    from shared.proto import encoder_pb2, encoder_pb2_grpc

    instance = (segment or "encdec-kv-ffffffffffffffff").removeprefix("encdec-kv-")
    target = encoder_pb2.KVTarget(
        transport="shm",
        segment=segment or "encdec-kv-ffffffffffffffff",
        shape=shape,
        dtype="float32",
        instance_id=instance,
    )
    block_size = max(shape[3], 1)
    request = encoder_pb2.EncodeRequest(
        request_id="direct",
        pcm=np.zeros(1600, "<f4").tobytes(),
        block_ids=list(range(-(-1500 // block_size))),
        target=target,
    )
    with grpc.insecure_channel(services.encoder_address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            encoder_pb2_grpc.EncoderServiceStub(channel).Encode(request, timeout=60)
    assert info.value.code() == code, info.value.details()
    assert_all_blocks_free(stub)
