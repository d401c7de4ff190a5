"""End to end: realtime transcription over TranscribeStream, through the real services (the session's tiny.en stack).

Audio is fed unpaced (as fast as gRPC takes it) where a test does not look at partials: the stream's events then
depend only on the audio (every utterance decoded once at its end), so a stream's finals must be the same alone and
beside seven others. One test feeds at twice real time to see partials come before the finals that settle them.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf
from test_e2e_whisper import assert_all_blocks_free

from decoder_svc.realtime.agreement import normalize
from encdec import DATA_DIR
from shared.proto import decoder_pb2, decoder_pb2_grpc

CLIPS = ("sample", "weather", "meeting")


def clip(name: str) -> np.ndarray:
    pcm, rate = sf.read(str(DATA_DIR / f"{name}.wav"), dtype="int16")
    assert rate == 16_000
    return pcm


def recording(names=CLIPS, pause_s: float = 1.5) -> np.ndarray:
    """int16 16 kHz: the clips with ``pause_s`` of silence before each and after the last."""
    gap = np.zeros(int(pause_s * 16_000), np.int16)
    return np.concatenate([part for n in names for part in (gap, clip(n))] + [gap])


def requests(pcm: np.ndarray, config: decoder_pb2.RealtimeConfig, speed: float = 0.0, chunk_s: float = 0.1,
             controls: dict[int, int] | None = None, stop: threading.Event | None = None):  # fmt: skip
    """The call's messages: ``config``, then ``pcm`` in ``chunk_s`` chunks (paced at ``speed`` x real time; 0 =
    unpaced), ``controls`` sent before the chunk of that index; ``stop`` set: the stream stops sending (hangs)."""
    yield decoder_pb2.TranscribeStreamRequest(config=config)
    step = int(chunk_s * 16_000)
    start = time.monotonic()
    for i, at in enumerate(range(0, pcm.size, step)):
        if controls and i in controls:
            yield decoder_pb2.TranscribeStreamRequest(control=controls[i])
        if stop is not None and stop.is_set():
            while True:
                time.sleep(0.05)
        if speed:
            time.sleep(max(0.0, start + at / 16_000 / speed - time.monotonic()))
        yield decoder_pb2.TranscribeStreamRequest(audio=pcm[at : at + step].tobytes())


def run_stream(stub, pcm, speed: float = 0.0, **config) -> list[tuple[float, decoder_pb2.TranscribeStreamResponse]]:
    """Every event of one stream with its receive time (seconds after the call started)."""
    config.setdefault("request_id", f"rt-{uuid.uuid4().hex[:10]}")
    start = time.monotonic()
    responses = stub.TranscribeStream(requests(pcm, decoder_pb2.RealtimeConfig(**config), speed), timeout=300)
    return [(time.monotonic() - start, r) for r in responses]


def of(events, kind: str) -> list:
    return [getattr(r, kind) for _, r in events if r.WhichOneof("event") == kind]


def file_words(stub, pcm: np.ndarray) -> list[str]:
    request = decoder_pb2.GenerateRequest(
        pcm=decoder_pb2.PcmAudio(samples=pcm.tobytes(), sample_rate=16_000, encoding="pcm_s16le")
    )
    return [normalize(w) for w in "".join(m.text for m in stub.Generate(request, timeout=120)).split()]


STEP_MS = 2000  # the tests' streams re-decode every 2 s of audio (the server's least is 1 s): half the compute


def test_stream_transcribes_each_utterance_and_finals_equal_alone_and_beside_seven_streams(tiny_stub):
    pcm = recording()
    word = decoder_pb2.TIMESTAMP_GRANULARITY_WORD
    alone = run_stream(tiny_stub, pcm, timestamps=word, step_ms=STEP_MS)
    kinds = [r.WhichOneof("event") for _, r in alone]
    assert kinds[0] == "started" and kinds[-1] == "end"
    finals, done = of(alone, "final"), of(alone, "utterance_done")
    assert kinds.count("speech_started") == kinds.count("speech_stopped") == len(done) >= len(CLIPS)
    assert [f.id for f in finals] == list(range(len(finals)))
    assert all(w.start <= w.end for f in finals for w in f.words) and all(f.words for f in finals)
    assert all(a.end <= b.start + 0.5 for a, b in zip(finals, finals[1:], strict=False))  # stream time goes on
    # the finals, joined, are the utterances' texts; most of the words are the file transcription's
    assert " ".join(d.text for d in done if d.text) == "".join(f.text for f in finals).strip()
    heard = [normalize(w) for f in finals for w in f.text.split()]
    expected = [w for n in CLIPS for w in file_words(tiny_stub, clip(n))]
    assert len(set(heard) & set(expected)) >= 0.75 * len(set(expected)), (heard, expected)
    end = of(alone, "end")[0]
    assert end.finals == len(finals) and end.utterances == len(done) and abs(end.audio_s - pcm.size / 16_000) < 0.01
    # beside seven other streams (shorter recordings, all at once): the same finals
    others = [recording(("short",), pause_s=1.0 + 0.1 * i) for i in range(7)]
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(run_stream, tiny_stub, pcm, timestamps=word, step_ms=STEP_MS)
        rest = [pool.submit(run_stream, tiny_stub, other, step_ms=STEP_MS) for other in others]
        beside = first.result()
        assert all(of(f.result(), "end") for f in rest)
    assert [(f.text, f.start, f.end) for f in of(beside, "final")] == [(f.text, f.start, f.end) for f in finals]
    assert_all_blocks_free(tiny_stub)
    record = tiny_stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=alone[0][1].request_id))
    assert record.state == decoder_pb2.REQUEST_STATE_FINISHED
    assert (record.audio_bytes, record.finals) == (pcm.nbytes, len(finals))


def test_partials_come_before_the_finals_that_settle_them(tiny_stub):
    pcm = recording(("sample",), pause_s=1.0)
    events = run_stream(tiny_stub, pcm, speed=2.0)
    kinds = [r.WhichOneof("event") for _, r in events]
    assert "partial" in kinds and kinds.index("partial") < kinds.index("final")
    finals = "".join(f.text for f in of(events, "final")).strip()
    assert finals == " ".join(d.text for d in of(events, "utterance_done") if d.text)
    assert len(finals.split()) >= 8
    off = run_stream(tiny_stub, pcm, speed=0.0, partials=False)
    assert not of(off, "partial") and of(off, "final")


def test_silence_and_faint_noise_give_no_words(tiny_stub):
    rng = np.random.default_rng(3)
    quiet = np.concatenate([np.zeros(5 * 16_000), rng.normal(0, 30, 10 * 16_000)]).astype(np.int16)  # -60 dBFS noise
    events = run_stream(tiny_stub, quiet, request_id="rt-quiet")
    assert [r.WhichOneof("event") for _, r in events] == ["started", "end"]
    assert of(events, "end")[0].finals == 0
    # nothing decoded, or no audio at all: the record still ends FINISHED (it stayed QUEUED, a new user found)
    empty = run_stream(tiny_stub, np.zeros(0, np.int16), request_id="rt-empty")
    assert [r.WhichOneof("event") for _, r in empty] == ["started", "end"]
    for request_id in ("rt-quiet", "rt-empty"):
        record = tiny_stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
        assert record.state == decoder_pb2.REQUEST_STATE_FINISHED, (request_id, record)
    # without VAD, the half-close decodes the whole 15 s: Whisper's no-speech rule keeps it silent too
    events = run_stream(tiny_stub, quiet, vad=decoder_pb2.RealtimeVad(disabled=True), step_ms=STEP_MS)
    assert not of(events, "final") and not "".join(d.text for d in of(events, "utterance_done"))


def test_continuous_speech_longer_than_the_window_loses_no_utterance(tiny_stub):
    names = ("sample", "weather", "meeting", "numbers", "weather", "short")  # 31 s, no VAD: one utterance
    pcm = np.concatenate([clip(n) for n in names])
    assert pcm.size > 31 * 16_000
    events = run_stream(tiny_stub, pcm, vad=decoder_pb2.RealtimeVad(disabled=True), step_ms=STEP_MS)
    finals = of(events, "final")
    assert len(of(events, "utterance_done")) == 1 and len(finals) >= 2
    text = [normalize(w) for f in finals for w in f.text.split()]
    # words of the first, middle and last clips are all there, in order, none twice over a cut
    for word in ("budget", "park", "thursday", "street", "door"):
        assert word in text, text
    assert finals[-1].end > 30.0
    assert all(a.end <= b.start + 0.2 for a, b in zip(finals, finals[1:], strict=False))


def test_commit_ends_an_utterance_and_clear_drops_one(tiny_stub):
    pcm = recording(("weather", "meeting"), pause_s=0.2)  # no VAD: utterances end at a commit or the half-close
    step = 1600
    control_at = (int(0.2 * 16_000) + clip("weather").size + 1600) // step
    config = decoder_pb2.RealtimeConfig(vad=decoder_pb2.RealtimeVad(disabled=True), step_ms=STEP_MS)

    def utterances(control):
        events = list(tiny_stub.TranscribeStream(requests(pcm, config, controls={control_at: control}), timeout=120))
        finals = [r for r in events if r.WhichOneof("event") == "final"]
        done = [r.utterance_done.text for r in events if r.WhichOneof("event") == "utterance_done"]
        texts = ["".join(r.final.text for r in finals if r.utterance == u).strip() for u in range(len(done))]
        assert texts == done  # each utterance's text is its finals, joined
        return [[normalize(w) for w in text.split()] for text in done]

    first, second = utterances(decoder_pb2.REALTIME_CONTROL_COMMIT)
    assert "park" in first and "afternoon" in first and "thursday" in second and "park" not in second
    # clear: the first utterance keeps only what was final before it (no "afternoon"), the second is whole
    first, second = utterances(decoder_pb2.REALTIME_CONTROL_CLEAR)
    assert "afternoon" not in first and "thursday" in second and "park" not in second


@pytest.mark.parametrize(
    "first, message",
    [
        (decoder_pb2.TranscribeStreamRequest(audio=b"\0\0"), "first message must be its config"),
        (decoder_pb2.TranscribeStreamRequest(config=decoder_pb2.RealtimeConfig(sample_rate=96_000)), "96000 Hz"),
        (decoder_pb2.TranscribeStreamRequest(config=decoder_pb2.RealtimeConfig(encoding="opus")), "'opus'"),
        (
            decoder_pb2.TranscribeStreamRequest(
                config=decoder_pb2.RealtimeConfig(vad=decoder_pb2.RealtimeVad(silence_duration_ms=5))
            ),
            "silence_duration_ms",
        ),
        (decoder_pb2.TranscribeStreamRequest(config=decoder_pb2.RealtimeConfig(language="de")), "English-only"),
        (decoder_pb2.TranscribeStreamRequest(config=decoder_pb2.RealtimeConfig(priority=-5)), "min-client-priority"),
    ],
)
def test_bad_stream_configs_are_refused_at_open(tiny_stub, first, message):
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stub.TranscribeStream(iter([first]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_bad_audio_mid_stream_fails_the_stream_and_leaves_nothing(tiny_stub):
    request_id = f"rt-bad-{uuid.uuid4().hex[:8]}"
    config = decoder_pb2.RealtimeConfig(request_id=request_id, encoding="pcm_f32le")
    speech = (clip("short").astype(np.float32) / 32768).astype("<f4")
    messages = [
        decoder_pb2.TranscribeStreamRequest(config=config),
        decoder_pb2.TranscribeStreamRequest(audio=speech.tobytes()),
        decoder_pb2.TranscribeStreamRequest(audio=np.array([np.nan, 0.0], "<f4").tobytes()),
    ]
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stub.TranscribeStream(iter(messages), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in info.value.details()
    record = tiny_stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert record.state == decoder_pb2.REQUEST_STATE_FAILED
    assert_all_blocks_free(tiny_stub)


def test_abort_disconnect_and_a_slow_reader(tiny_stub):
    pcm = recording(("sample", "weather"), pause_s=1.0)
    # Abort RPC mid-stream: the stream ends with its end event, recorded ABORTED
    request_id = f"rt-abort-{uuid.uuid4().hex[:8]}"
    hang = threading.Event()
    call = tiny_stub.TranscribeStream(
        requests(pcm, decoder_pb2.RealtimeConfig(request_id=request_id), speed=2.0, stop=hang), timeout=120
    )
    got = []
    for response in call:
        got.append(response.WhichOneof("event"))
        if got[-1] == "final" and not hang.is_set():
            hang.set()
            assert tiny_stub.Abort(decoder_pb2.AbortRequest(request_id=request_id)).aborted
    assert got[-1] == "end"
    assert tiny_stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id)).state == (
        decoder_pb2.REQUEST_STATE_ABORTED
    )
    # the client vanishes mid-utterance: everything is freed within a few seconds, recorded ABORTED
    request_id = f"rt-gone-{uuid.uuid4().hex[:8]}"
    call = tiny_stub.TranscribeStream(requests(pcm, decoder_pb2.RealtimeConfig(request_id=request_id), speed=2.0))
    for response in call:
        if response.WhichOneof("event") == "speech_started":
            break
    time.sleep(1.5)
    call.cancel()
    assert_all_blocks_free(tiny_stub, timeout_s=5.0)
    deadline = time.monotonic() + 5
    while tiny_stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id)).state != (
        decoder_pb2.REQUEST_STATE_ABORTED
    ):
        assert time.monotonic() < deadline, "the vanished stream's record did not end ABORTED"
        time.sleep(0.1)
    # a reader that does not read for a while gets every event after, the same as a prompt reader
    prompt = [
        (r.WhichOneof("event"), str(r)) for _, r in run_stream(tiny_stub, pcm, request_id="rt-prompt", step_ms=STEP_MS)
    ]
    config = decoder_pb2.RealtimeConfig(request_id="rt-slow", step_ms=STEP_MS)
    call = tiny_stub.TranscribeStream(requests(pcm, config), timeout=120)
    time.sleep(4)
    slow = [(r.WhichOneof("event"), str(r).replace("rt-slow", "rt-prompt")) for r in call]
    assert slow == prompt


def test_an_utterance_whose_decode_hears_only_its_context_is_decoded_without_it(base_stub, tmp_path_factory):
    """The bench's lost utterance (whisper-base, the quality corpus's ``pauses-0``): the decodes of its fourth
    sentence (19.8-23.9 s) hear 8 s of context before it, and the model transcribed the context sentence and
    ended there, every step and the utterance's end: an empty ``utterance_done``. Such an utterance is decoded
    without its context: every sentence of the first 25 s comes out, each in its own utterance."""
    from encdec.bench.quality_corpus import build_corpus, load_corpus

    root = build_corpus(tmp_path_factory.mktemp("quality-corpus"), subsets=["pauses"])
    meta = next(f for f in load_corpus(root, ["pauses"]) if f.name == "pauses-0")
    pcm, rate = sf.read(root / "pauses-0.wav", dtype="int16")
    assert rate == 16_000
    events = run_stream(base_stub, pcm[: 25 * 16_000], language="en")
    done = [d.text for d in of(events, "utterance_done")]
    assert len(done) == 4 and all(done), done
    assert "teacher opened the window" in normalize_text(done[3]), done
    assert meta.sentences[3][0] < 20.0 < meta.sentences[3][1]  # the corpus still puts that sentence there
    assert_all_blocks_free(base_stub)


def normalize_text(text: str) -> str:
    return " ".join(normalize(w) for w in text.split())


@pytest.fixture(scope="module")
def measured_stub(redis_url, tmp_path_factory):
    """A tiny.en stack of its own with the measured-capacity rule on (the session's stack has it off) and room for
    64 streams by count, so capacity is what refuses."""
    from helpers.stacks import TINY, stack

    with stack(TINY, redis_url, tmp_path_factory.mktemp("rt-capacity-logs"), ("--max-realtime-streams", "64")) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield decoder_pb2_grpc.DecoderServiceStub(channel)


def test_a_burst_of_streams_past_the_measured_capacity_is_refused_at_open(measured_stub):
    """Admission (the bench's burst of 8 streams opened before any step ran, all admitted, all behind): once the
    replica has timed a stream's steps, streams opened one after another, each staying open, are admitted while
    their projected decoding fits the replica, and the next is refused with RESOURCE_EXHAUSTED naming
    --realtime-capacity (how many fit depends on the CPU: a tiny.en step costs 0.1-0.5 s on 2 cores); closing
    them frees everything, and a stream opens again."""
    pcm = recording(("sample",), pause_s=0.5)
    assert of(run_stream(measured_stub, pcm), "final")  # a step's cost is measured now
    hang = threading.Event()
    hang.set()  # each stream sends its config and first chunk, then nothing: it stays open
    calls, refusal = [], None
    for i in range(40):
        call = measured_stub.TranscribeStream(
            requests(pcm, decoder_pb2.RealtimeConfig(request_id=f"rt-burst-{i}-{uuid.uuid4().hex[:6]}"), stop=hang),
            timeout=60,
        )
        calls.append(call)
        try:
            assert next(call).WhichOneof("event") == "started"
        except grpc.RpcError as exc:
            refusal = exc
            break
    for call in calls:
        call.cancel()
    assert refusal is not None and refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
    assert "--realtime-capacity" in refusal.details() and len(calls) >= 2, (len(calls), refusal.details())
    assert_all_blocks_free(measured_stub, timeout_s=5.0)
    deadline = time.monotonic() + 10  # the cancelled calls leave the decoder's stream table as their cancels land
    while True:
        try:
            assert of(run_stream(measured_stub, pcm), "final")
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
            time.sleep(0.5)
