"""A realtime stream's audio chunks -> 16 kHz float32 samples, chunk after chunk.

Chunks may split a sample anywhere (an odd byte count of int16): the bytes left over wait for the next chunk.
Rates other than 16 kHz are resampled with soxr's streaming resampler (``soxr.ResampleStream``, the library the
file path resamples with), so a stream's samples are the same however the client cut its chunks.
"""

from __future__ import annotations

import numpy as np

from decoder_svc.session.audio_limits import AudioError, check_float_samples

SAMPLE_RATE = 16_000  # what Whisper and silero-vad take
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8_000, 48_000
ENCODINGS = {"pcm_s16le": np.dtype("<i2"), "pcm_f32le": np.dtype("<f4")}
DEFAULT_ENCODING = "pcm_s16le"
# float32 samples must be finite and within +-64 (``audio_limits.MAX_FLOAT_AMPLITUDE``, the rule of every PCM input): a
# wrong encoding or gain decodes to garbage, and it would poison the stream's VAD state.
MAX_CHUNK_BYTES = 4 << 20  # one message's audio (131 s of 16 kHz int16); the gRPC message limit bounds it too


def check_format(sample_rate: int, encoding: str) -> tuple[int, str]:
    """The stream's sample rate (0 = 16000) and encoding ("" = pcm_s16le), checked.

    Raises:
        AudioError: a rate outside [8000, 48000] Hz or an unknown encoding.
    """
    rate = sample_rate or SAMPLE_RATE
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioError(
            f"audio sample_rate {rate} Hz is not taken by realtime streams: send {MIN_SAMPLE_RATE}-"
            f"{MAX_SAMPLE_RATE} Hz mono PCM (16000 is decoded without resampling)"
        )
    name = (encoding or DEFAULT_ENCODING).strip().lower()
    if name not in ENCODINGS:
        raise AudioError(f"audio encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    return rate, name


class ChunkDecoder:
    """One stream's PCM chunks -> float32 16 kHz (``feed``, then ``flush`` at its end).

    Args:
        sample_rate: Hz of the chunks (checked by ``check_format``). encoding: ``pcm_s16le`` / ``pcm_f32le``.
    """

    def __init__(self, sample_rate: int, encoding: str) -> None:
        self.sample_rate, self.encoding = check_format(sample_rate, encoding)
        self.dtype = ENCODINGS[self.encoding]
        self._left = b""  # bytes of a sample split across chunks
        self._resampler = None
        if self.sample_rate != SAMPLE_RATE:
            import soxr

            self._resampler = soxr.ResampleStream(self.sample_rate, SAMPLE_RATE, 1, dtype="float32")
        self.bytes_received = 0

    def feed(self, chunk: bytes) -> np.ndarray:
        """The 16 kHz samples ``chunk`` completes ([n] float32; n may be 0).

        Raises:
            AudioError: a chunk over ``MAX_CHUNK_BYTES``; float samples not finite or beyond +-64
                (``audio_limits.check_float_samples``).
        """
        if len(chunk) > MAX_CHUNK_BYTES:
            raise AudioError(f"audio chunk of {len(chunk)} bytes is over {MAX_CHUNK_BYTES}; send smaller chunks")
        self.bytes_received += len(chunk)
        data = self._left + chunk
        whole = len(data) - len(data) % self.dtype.itemsize
        self._left = data[whole:]
        samples = np.frombuffer(data[:whole], dtype=self.dtype)
        if self.dtype.kind == "i":
            pcm = samples.astype(np.float32) / 32768.0
        else:
            pcm = samples.astype(np.float32)
            check_float_samples(pcm, "scale them to [-1, 1], or if the stream is int16 say encoding pcm_s16le")
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm)
        return np.ascontiguousarray(pcm, dtype=np.float32)

    def flush(self) -> np.ndarray:
        """The resampler's tail at the stream's end ([n] float32); a split sample left over is dropped."""
        self._left = b""
        if self._resampler is None:
            return np.zeros(0, np.float32)
        return np.ascontiguousarray(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True), np.float32)


class StreamAudio:
    """The recent audio of a stream, addressed by stream sample (16 kHz; sample 0 = the stream's first).

    Chunks are kept as they came and joined only when a decode asks for a range; ``drop_before`` forgets what no
    decode will read again, so a stream of any length holds at most its current utterance (<= 30 s) and some
    padding.
    """

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self.start = 0  # stream sample of the first kept sample
        self.end = 0  # stream samples received

    def append(self, pcm: np.ndarray) -> None:
        if pcm.size:
            self._chunks.append(pcm)
            self.end += pcm.size

    def slice(self, start: int, end: int) -> np.ndarray:
        """``[end - start]`` float32 samples of ``[start, end)``, clipped to what is kept."""
        start, end = max(start, self.start), min(end, self.end)
        if end <= start:
            return np.zeros(0, np.float32)
        joined = np.concatenate(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks = [joined]
        return joined[start - self.start : end - self.start].copy()

    def drop_before(self, sample: int) -> None:
        """Forgets the samples before ``sample``."""
        sample = min(max(sample, self.start), self.end)
        drop = sample - self.start
        while drop and self._chunks:
            head = self._chunks[0]
            if head.size <= drop:
                self._chunks.pop(0)
                drop -= head.size
                self.start += head.size
            else:
                self._chunks[0] = head[drop:]
                self.start += drop
                drop = 0
