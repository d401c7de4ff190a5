"""What audio the decoder accepts (``--max-audio-s``, ``--max-audio-sample-rate``, ``--max-audio-channels``) and the
error every refusal raises.

Every check raises ``AudioError`` (a ``ValueError``; servicers answer it INVALID_ARGUMENT, the gateway 400) with
a message naming what was wrong, the limit and the flag that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# What an error tells a user to send instead (the formats of OpenAI's transcription API, and the rest FFmpeg reads).
FORMATS_HINT = "send an audio or video file (wav, flac, mp3, m4a, mp4, ogg, opus, webm, ...) or raw PCM"
MIN_SAMPLE_RATE = 1_000  # Hz; below it no speech band survives
# Hz; the highest rate of studio and "hi-res" recordings (2x 96 kHz). Higher rates (DXD 352.8 / 384 kHz) only
# cost decode time: --max-audio-sample-rate takes them.
DEFAULT_MAX_SAMPLE_RATE = 192_000
DEFAULT_MAX_CHANNELS = 8  # 7.1 surround; more is a multitrack session, not a recording to transcribe
# Float samples are nominally in [-1, 1] (full scale). A float recording may overshoot that (a mix that clipped,
# a resampler's inter-sample peaks, a few dB of headroom), never by 36 dB: 64 (+36 dBFS) leaves room for any real
# recording and refuses what a wrong encoding or gain gives (int16 values sent as float reach thousands; int16 bytes
# read as float32 give NaN and magnitudes up to 3e38). Whisper decodes such input to garbage (1e38: 446 "!" tokens).
MAX_FLOAT_AMPLITUDE = 64.0


class AudioError(ValueError):
    """The audio cannot be used; the message says why and what to send.

    Every message starts with "audio" ("audio: " is put before one that does not), so a client (the HTTP
    gateway's ``param: "file"``) can tell an error about the audio from one about another field."""

    def __init__(self, message: str) -> None:
        super().__init__(message if message.startswith("audio") else f"audio: {message}")


def check_float_samples(audio: np.ndarray, hint: str = "scale them to [-1, 1]") -> None:
    """Refuses float samples Whisper cannot hear: NaN, infinite, or beyond +-``MAX_FLOAT_AMPLITUDE``.

    Args:
        audio: ``[N]`` float samples as sent (before any resampling), nominally in [-1, 1].
        hint: what the message tells the user to do (in parentheses after what was wrong).

    Raises:
        AudioError: a NaN / infinite sample, or one whose magnitude is over ``MAX_FLOAT_AMPLITUDE`` (the message
            names the largest magnitude and the bound).
    """
    if not audio.size:
        return
    if not np.isfinite(audio).all():
        raise AudioError(f"audio contains NaN or infinite samples; send finite float samples in [-1, 1] ({hint})")
    peak = float(np.abs(audio).max())
    if peak > MAX_FLOAT_AMPLITUDE:
        raise AudioError(
            f"audio float samples reach {peak:.3g}; float samples are in [-1, 1] and this server refuses any beyond "
            f"+-{MAX_FLOAT_AMPLITUDE:g} ({hint})"
        )


@dataclass(frozen=True)
class AudioLimits:
    """The audio a request may carry.

    Attributes:
        max_duration_s: longest audio in seconds (``--max-audio-s``); None = no limit.
        max_sample_rate: highest input sample rate in Hz (``--max-audio-sample-rate``).
        max_channels: most input channels (``--max-audio-channels``).
    """

    max_duration_s: float | None = None
    max_sample_rate: int = DEFAULT_MAX_SAMPLE_RATE
    max_channels: int = DEFAULT_MAX_CHANNELS

    def check_rate(self, rate) -> None:
        """Raises ``AudioError`` for a rate that is not an integer in [MIN_SAMPLE_RATE, max_sample_rate] Hz."""
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate < MIN_SAMPLE_RATE:
            raise AudioError(
                f"bad sample rate {rate!r} Hz; must be an integer between {MIN_SAMPLE_RATE} and {self.max_sample_rate}"
            )
        if rate > self.max_sample_rate:
            raise AudioError(
                f"sample rate {rate} Hz is above this server's limit of {self.max_sample_rate} Hz "
                "(--max-audio-sample-rate); resample the audio (16 kHz is all Whisper uses)"
            )

    def check_channels(self, channels: int) -> None:
        """Raises ``AudioError`` for no channels or more than ``max_channels``."""
        if channels < 1:
            raise AudioError("the audio stream declares no channels; the file is corrupt")
        if channels > self.max_channels:
            raise AudioError(
                f"audio has {channels} channels; this server accepts at most {self.max_channels} "
                "(--max-audio-channels); mix it down (Whisper hears one channel)"
            )

    def check_duration(self, seconds: float, source: str = "", stopped: bool = False) -> None:
        """Raises ``AudioError`` when ``seconds`` passes ``max_duration_s``.

        Args:
            seconds: the length known so far, in seconds (a header's, or what was decoded).
            source: how it was learned, for the message (" by its header").
            stopped: ``seconds`` is what was decoded when decoding stopped (the file holds at least that much).
        """
        if self.max_duration_s is None or seconds <= self.max_duration_s:
            return
        limit = f"{self.max_duration_s:.2f}s (--max-audio-s)"
        if stopped:
            raise AudioError(
                f"audio is longer than the maximum of {limit}: decoding stopped at {seconds:.2f}s; send a shorter clip"
            )
        raise AudioError(f"audio is {seconds:.2f}s long{source}; the maximum is {limit}; send a shorter clip")
