"""The realtime stream's pure parts: LocalAgreement-2, chunk decoding, the stream audio buffer, batched turn
detection (the real silero-vad model)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import soundfile as sf

from decoder_svc.realtime.agreement import LocalAgreement, TimedWord
from decoder_svc.realtime.stream_admission import StreamAdmission
from decoder_svc.realtime.stream_audio import ChunkDecoder, StreamAudio, check_format
from decoder_svc.realtime.stream_vad import StreamVad, TurnOptions, run_batch
from decoder_svc.session.audio_limits import AudioError
from decoder_svc.whisper.vad import speech_probabilities
from encdec import DATA_DIR


def words(text: str, start: float = 0.0, step: float = 0.5) -> list[TimedWord]:
    return [TimedWord(" " + w, start + i * step, start + (i + 1) * step) for i, w in enumerate(text.split())]


def test_local_agreement_finalizes_the_common_prefix_of_two_hypotheses():
    la = LocalAgreement()
    assert la.insert(words("the quick")) == []  # nothing to agree with yet
    assert [w.text for w in la.insert(words("the quick brown"))] == [" the", " quick"]
    assert [w.text for w in la.pending] == [" brown"]
    # the hypothesis changes its tail: only what two agree on becomes final, compared without case / punctuation
    assert [w.text for w in la.insert(words("The Quick, brown fox"))] == [" brown"]
    assert la.insert(words("the quick brown fax jumps")) == []  # "fox" / "fax": the partial changes
    assert [w.text for w in la.flush()] == [" fax", " jumps"]
    assert [w.text for w in la.final] == [" the", " quick", " brown", " fax", " jumps"]


def test_local_agreement_never_sends_a_final_word_twice():
    la = LocalAgreement()
    la.insert(words("one two three"))
    la.insert(words("one two three four"))  # one two three final, ending at 1.5 s
    # a trimmed buffer restarts at 1.0 s: its head repeats the finals by time and by n-gram
    again = [TimedWord(" three", 1.05, 1.5), TimedWord(" four", 1.5, 2.0), TimedWord(" five", 2.0, 2.5)]
    assert la.insert(again) == [TimedWord(" four", 1.5, 2.0)]
    assert [w.text for w in la.final] == [" one", " two", " three", " four"]
    assert [w.text for w in la.flush()] == [" five"]


def test_an_utterances_first_word_timed_before_its_start_in_one_hypothesis_still_becomes_final():
    """The bench's lost "The" (whisper-base, "The lighthouse keeper ..."): the utterance starts at 32.87 s (its
    floor); one hypothesis times "The" at 32.95-33.2 s, the next at 32.6-33.2 s. Dropped by its start, it was in
    one hypothesis only and never became final; a word is context only when it ends before the floor."""
    la = LocalAgreement()
    la.floor = 32.87
    context = [TimedWord(" lake.", 29.6, 30.0)]  # the utterance before, heard again as context
    first = context + [TimedWord(" The", 32.95, 33.2), *words("lighthouse keeper", 33.2, 0.4)]
    second = context + [TimedWord(" The", 32.6, 33.2), *words("lighthouse keeper climbs", 33.2, 0.4)]
    assert la.insert(first) == []
    assert [w.text for w in la.insert(second)] == [" The", " lighthouse", " keeper"]
    assert [w.text for w in la.flush()] == [" climbs"]


def test_chunk_decoder_joins_split_samples_and_resamples_in_any_chunking():
    rng = np.random.default_rng(0)
    pcm = (rng.uniform(-0.5, 0.5, 24_000) * 32767).astype("<i2")
    raw = pcm.tobytes()
    whole = ChunkDecoder(24_000, "pcm_s16le")
    one = np.concatenate([whole.feed(raw), whole.flush()])
    cut = ChunkDecoder(24_000, "")
    parts = [cut.feed(raw[i : i + 777]) for i in range(0, len(raw), 777)]  # odd sizes split int16 samples
    many = np.concatenate([*parts, cut.flush()])
    assert abs(one.size - 16_000) <= 2 and many.size == one.size
    np.testing.assert_allclose(many, one, atol=1e-6)
    same = ChunkDecoder(16_000, "pcm_s16le")
    np.testing.assert_array_equal(same.feed(raw[:3]), pcm[:1].astype(np.float32) / 32768)  # the odd byte waits


@pytest.mark.parametrize(
    "rate, encoding, message",
    [(44, "", "sample_rate 44 Hz"), (96_000, "", "sample_rate 96000"), (16_000, "mp3", "encoding 'mp3'")],
)
def test_stream_formats_out_of_range_are_refused(rate, encoding, message):
    with pytest.raises(AudioError, match=message):
        check_format(rate, encoding)


def test_float_chunks_must_be_finite_and_near_full_scale():
    dec = ChunkDecoder(16_000, "pcm_f32le")
    with pytest.raises(AudioError, match="NaN or infinite"):
        dec.feed(np.array([0.1, np.nan], "<f4").tobytes())
    with pytest.raises(AudioError, match="pcm_s16le"):
        dec.feed(np.array([1e38], "<f4").tobytes())
    with pytest.raises(AudioError, match=r"reach 65.*beyond \+-64"):  # the bound of every PCM input
        dec.feed(np.array([65.0], "<f4").tobytes())
    assert dec.feed(np.array([-64.0, 2.0], "<f4").tobytes()).tolist() == [-64.0, 2.0]


def test_stream_audio_keeps_only_what_is_asked_for():
    buf = StreamAudio()
    for i in range(5):
        buf.append(np.full(100, i, np.float32))
    buf.drop_before(250)
    assert (buf.start, buf.end) == (250, 500)
    np.testing.assert_array_equal(buf.slice(0, 310), np.array([2] * 50 + [3] * 10, np.float32))
    buf.drop_before(10_000)
    assert buf.start == buf.end == 500 and buf.slice(0, 500).size == 0


def test_batched_stream_vad_equals_silero_window_by_window_and_finds_turns():
    speech, _ = sf.read(str(DATA_DIR / "short.wav"), dtype="float32")
    silence = np.zeros(16_000, np.float32)
    audio = np.concatenate([silence, speech, silence])
    a, b = StreamVad(TurnOptions()), StreamVad(TurnOptions())
    turns_a, probs_a = [], []
    for i in range(0, audio.size, 1600):  # 100 ms chunks, the two streams batched together
        wa, wb = a.windows(audio[i : i + 1600]), b.windows(np.zeros(1600, np.float32))
        pa, pb = run_batch([(a, wa), (b, wb)])
        probs_a += pa
        turns_a += a.turns(pa)
        b.turns(pb)
    reference = speech_probabilities(audio[: len(probs_a) * 512])[:64]  # silero from its reset state (row 0)
    np.testing.assert_allclose(probs_a[:64], reference, atol=1e-4)
    assert [t.kind for t in turns_a] == ["start", "pause", "stop"]
    assert turns_a[1].sample == turns_a[2].sample and turns_a[1].heard_at < turns_a[2].heard_at
    start, stop = (t.sample / 16_000 for t in turns_a if t.kind != "pause")
    assert 0.9 <= start <= 1.2 and 1.0 + speech.size / 16_000 - 0.5 <= stop <= 1.1 + speech.size / 16_000
    assert not b.speaking


class _Stream:
    """What admission reads of a live stream's session."""

    def __init__(self, step_s: float = 1.0) -> None:
        self.settings = types.SimpleNamespace(step_s=step_s)
        self.open, self.step_time_s = True, 0.0


def _stream(step_s: float = 1.0) -> _Stream:
    return _Stream(step_s)


def test_admission_refuses_a_stream_past_the_measured_capacity_even_before_its_peers_timed_a_step():
    """The bench's burst: 8 streams opened within 2 s, before any had decoded a step, were all admitted and all fell
    behind. With a step's cost measured (the median of the timed steps, here 0.3 s each of two streams decoding
    together: 0.15 s a stream), a new stream is admitted while the streams' decoding per second of audio, its own
    included, fits the capacity."""
    from shared.errors import ResourceExhaustedError

    admission = StreamAdmission(max_streams=16, step_s=1.0, capacity=1.0)
    admission.check()  # a fresh replica: nothing measured, the count rule only
    a, b = _stream(), _stream()
    admission.open(a), admission.open(b)
    admission.observe(3.0)  # a fresh decoder's first step (its warm-up): one of the median's samples only
    admission.observe(0.3)
    assert admission.step_cost_s is None and admission.load() == 0.0  # too few steps timed to tell
    admission.observe(0.3)
    assert admission.step_cost_s == pytest.approx(0.15) and admission.load() == pytest.approx(0.3)
    for _ in range(4):  # 4 more streams not timed yet: 6 x 0.15 = 0.9
        admission.check()
        admission.open(_stream())
    with pytest.raises(ResourceExhaustedError, match="--realtime-capacity"):
        admission.check()  # a 7th: 1.05
    admission.check(step_s=2.0)  # one that re-decodes every 2 s needs half as much: 0.975
    admission.close(a)
    admission.check()  # one left: room again
    assert StreamAdmission(16, 1.0, capacity=0).load() == 0.0  # nothing measured yet
    off = StreamAdmission(max_streams=16, step_s=1.0, capacity=0)
    off.open(_stream())
    for _ in range(3):
        off.observe(0.9)
    for _ in range(10):
        off.check()
        off.open(_stream())
