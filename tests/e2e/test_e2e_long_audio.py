"""Whisper audio longer than 30 s, end to end: Redis + encoder_svc + decoder_svc as separate processes.

A 45 s clip is built at test time from the committed clips (encdec/data/*.wav,
in name order, each followed by 0.6 s of silence, repeated and cut at 45 s;
the 30 s window edge falls inside a word). The decoder runs it as two
consecutive windows (30 s + 15 s) in one request; the reference is HF
``generate`` on each window's samples alone (padded to 30 s by the feature
extractor, as the encoder service does), i.e. HF's chunked transcription
without stride, joined.
"""

from __future__ import annotations

import io
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch
from test_e2e_whisper import assert_all_blocks_free, wait_state

from decoder_svc.inputs import WINDOW_SAMPLES, RequestInput
from encdec import DATA_DIR
from encdec.launcher import Services
from shared.models.registry import resolve_model
from shared.models.whisper_features import load_tokenizer, log_mel_spectrogram
from shared.proto import decoder_pb2, decoder_pb2_grpc

DATA = DATA_DIR
RATE = 16000
LONG_S = 45.0
GAP_S = 0.6
EOT = 50256
MAX_AUDIO_S = 50  # the decoder's --max-audio-s here (the default 600 s is checked in test_e2e_whisper.py)


def long_clip(seconds: float = LONG_S) -> np.ndarray:
    """``[seconds * 16000]`` float32: the committed clips with 0.6 s gaps, repeated, cut at ``seconds``."""
    parts, total, target = [], 0, int(seconds * RATE)
    clips = [sf.read(p, dtype="float32")[0] for p in sorted(DATA.glob("*.wav"))]
    while total < target:
        for pcm in clips:
            parts += [pcm, np.zeros(int(GAP_S * RATE), np.float32)]
            total += len(pcm) + int(GAP_S * RATE)
    return np.concatenate(parts)[:target]


def join_windows(texts: list[str]) -> str:
    """Window texts as the stream joins them: a space only where neither side has one."""
    out = ""
    for text in texts:
        if out and text and not out[-1].isspace() and not text[0].isspace():
            out += " "
        out += text
    return out


def split_windows(tokens: list[int]) -> list[list[int]]:
    """The streamed token ids cut after each window's end token (end tokens dropped)."""
    windows, current = [], []
    for t in tokens:
        if t == EOT:
            windows.append(current)
            current = []
        else:
            current.append(t)
    assert not current, "the stream must end with the last window's end token"
    return windows


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return long_clip()


@pytest.fixture(scope="module")
def hf_windows(hf_whisper, clip) -> list[list[int]]:
    """HF greedy ids (no prompt, no end token) of each 30 s window of the clip, each run alone."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(clip), WINDOW_SAMPLES):
            feats = log_mel_spectrogram(clip[start : start + WINDOW_SAMPLES])  # [80, 3000]
            out.append(hf_whisper.generate(feats[None]).tolist()[0])
    return out


@pytest.fixture(scope="module")
def services(redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("long-audio-logs")
    no_metrics = ["--metrics-port", "0"]  # other test modules may run services beside these
    with Services(
        redis_url=redis_url,
        log_dir=str(log_dir),
        extra_encoder_args=no_metrics,
        extra_decoder_args=[*no_metrics, "--max-audio-s", str(MAX_AUDIO_S)],
    ) as svc:
        yield svc


@pytest.fixture(scope="module")
def stub(services):
    with grpc.insecure_channel(services.decoder_address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


def _pcm(samples: np.ndarray, rate: int = RATE) -> decoder_pb2.PcmAudio:
    return decoder_pb2.PcmAudio(samples=samples.astype("<f4").tobytes(), sample_rate=rate)


def _wav(samples: np.ndarray, rate: int = RATE, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def test_windows_split_the_whole_clip(clip):
    windows = RequestInput(1500, pcm=clip).windows()
    assert [len(w.pcm) for w in windows] == [WINDOW_SAMPLES, len(clip) - WINDOW_SAMPLES]
    assert np.array_equal(np.concatenate([w.pcm for w in windows]), clip)  # nothing cut, nothing repeated
    assert all(w.encoder_len == 1500 and w.prompt_token_ids is None for w in windows)
    exact = RequestInput(1500, pcm=np.zeros(2 * WINDOW_SAMPLES, np.float32)).windows()
    assert [len(w.pcm) for w in exact] == [WINDOW_SAMPLES] * 2
    assert len(RequestInput(1500, pcm=clip[:WINDOW_SAMPLES]).windows()) == 1


def test_window_texts_join_with_one_space():
    from decoder_svc.request_progress import RequestProgress as _Active

    active = _Active(RequestInput(1500))
    streamed = [active.stream_text(t) for t in ["", " One", " two."]]
    active.window, active.window_text_started = 1, False  # as _start_window leaves it
    streamed += [active.stream_text(t) for t in ["", "three", " four"]]
    active.window, active.window_text_started = 2, False
    streamed += [active.stream_text(t) for t in [" five"]]
    assert "".join(streamed) == " One two. three four five" == join_windows([" One two.", "three four", " five"])


def test_45s_clip_is_two_windows_matching_hf(stub, clip, hf_windows):
    tokenizer = load_tokenizer(resolve_model("whisper-tiny.en")[1])
    request_id = f"long-{uuid.uuid4().hex[:8]}"
    messages = list(stub.Generate(decoder_pb2.GenerateRequest(request_id=request_id, pcm=_pcm(clip)), timeout=300))
    tokens = [t for m in messages for t in m.token_ids]
    assert split_windows(tokens) == hf_windows
    assert all(len(w) > 5 for w in hf_windows)

    streamed = "".join(m.text for m in messages)
    window_texts = [tokenizer.decode(w, skip_special_tokens=True) for w in hf_windows]
    assert streamed == join_windows(window_texts)
    # HF's own chunked join (decode the chunks' tokens together) gives the same text.
    assert streamed == tokenizer.decode([t for w in hf_windows for t in w], skip_special_tokens=True)

    final = messages[-1]
    assert all(m.finish_reason == decoder_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert final.finish_reason == decoder_pb2.FINISH_REASON_STOP and final.stop_token_id == EOT
    assert final.usage.prompt_tokens == 2 * 2 and final.usage.encoder_tokens == 2 * 1500
    assert final.usage.completion_tokens == len(tokens) == sum(len(w) + 1 for w in hf_windows)
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_FINISHED)
    assert record.finish_reason == "stop"
    assert record.prompt_tokens == 4 and record.completion_tokens == len(tokens)
    assert_all_blocks_free(stub)


def test_windows_batch_with_other_requests(stub, clip, hf_windows):
    """The long request's windows run in the same batches as 30 s requests (each window alone, sent beside it)."""
    requests = {"long": clip, "first": clip[:WINDOW_SAMPLES], "second": clip[WINDOW_SAMPLES:]}
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {
            name: pool.submit(
                lambda pcm: list(stub.Generate(decoder_pb2.GenerateRequest(pcm=_pcm(pcm)), timeout=300)), pcm
            )
            for name, pcm in requests.items()
        }
        tokens = {name: [t for m in f.result() for t in m.token_ids] for name, f in futures.items()}
    assert split_windows(tokens["long"]) == hf_windows
    assert split_windows(tokens["first"]) == hf_windows[:1] and split_windows(tokens["second"]) == hf_windows[1:]
    assert_all_blocks_free(stub)


def test_max_tokens_counts_over_the_whole_request(stub, clip, hf_windows):
    budget = len(hf_windows[0]) + 1 + 3  # the first window, its end token, 3 tokens of the second
    messages = list(
        stub.Generate(
            decoder_pb2.GenerateRequest(pcm=_pcm(clip), sampling=decoder_pb2.SamplingParams(max_tokens=budget)),
            timeout=300,
        )
    )
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == [*hf_windows[0], EOT, *hf_windows[1][:3]]
    assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == budget
    assert_all_blocks_free(stub)


def _start_second_window(stub, request_id: str, audio: bytes):
    """Starts a Generate on ``audio`` and reads until the second window's first token; returns (call, tokens read)."""
    call = stub.Generate(decoder_pb2.GenerateRequest(request_id=request_id, audio=audio), timeout=300)
    tokens: list[int] = []
    for message in call:
        tokens += message.token_ids
        if EOT in tokens and tokens[-1] != EOT:
            return call, tokens
    raise AssertionError(f"the stream ended before a second window's token: {tokens}")


def test_abort_mid_second_window_frees_blocks(stub, clip, hf_windows):
    request_id = f"long-abort-{uuid.uuid4().hex[:8]}"
    call, tokens = _start_second_window(stub, request_id, _wav(clip))  # WAV: the file path of the same samples
    assert tokens[: len(hf_windows[0]) + 1] == [*hf_windows[0], EOT]
    assert stub.Abort(decoder_pb2.AbortRequest(request_id=request_id)).aborted
    rest = list(call)
    tokens += [t for m in rest for t in m.token_ids]
    final = rest[-1]
    assert final.finish_reason == decoder_pb2.FINISH_REASON_ABORT
    assert final.usage.completion_tokens == len(tokens) and final.usage.prompt_tokens == 4
    assert final.usage.encoder_tokens == 3000
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_ABORTED)
    assert record.finish_reason == "abort" and record.completion_tokens == len(tokens) and record.prompt_tokens == 4
    assert_all_blocks_free(stub)


def test_disconnect_mid_second_window_records_aborted(stub, clip):
    request_id = f"long-cancel-{uuid.uuid4().hex[:8]}"
    call, _ = _start_second_window(stub, request_id, _wav(clip))
    call.cancel()
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_ABORTED)
    assert record.finish_reason == "abort" and record.prompt_tokens == 4
    assert_all_blocks_free(stub)


@pytest.mark.parametrize("kind", ["audio", "pcm"])
def test_over_configured_limit_is_invalid_argument(stub, kind):
    seconds, rate = MAX_AUDIO_S + 1, 8000  # checked before resampling
    samples = np.zeros(seconds * rate, np.float32)
    fields = {"audio": _wav(samples, rate, "PCM_U8")} if kind == "audio" else {"pcm": _pcm(samples, rate)}
    request_id = f"long-over-{uuid.uuid4().hex[:8]}"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(decoder_pb2.GenerateRequest(request_id=request_id, **fields), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{seconds:.2f}" in info.value.details() and f"{MAX_AUDIO_S:.2f}" in info.value.details(), (
        info.value.details()
    )
    with pytest.raises(grpc.RpcError) as missing:  # no Redis record left behind
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert_all_blocks_free(stub)
