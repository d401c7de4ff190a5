"""Turns a ``GenerateRequest``'s input into what the engine and the encoder need.

Audio models (Whisper): decoded / resampled PCM, a fixed ``encoder_len``, and for
a request with one sample and one beam its ``WhisperJob`` (language, task,
prompt, timestamps, long-form rules: ``decoder_svc.whisper.options``), which
``decoder_svc.session.whisper_session`` runs; up to ``max_audio_s`` is accepted, never
cut. Audio over 30 s takes n = 1 and num_beams = 1 only.

Text models (T5, BART, mBART, Marian): source token ids (from ``text``
through the checkpoint's tokenizer, or ``input_ids`` as given),
``encoder_len`` = their count, decoder prompt = ``decoder_start_token_id`` +
the optional prefix.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from decoder_svc.session.audio import AudioLimits, decode_audio, pcm_to_array
from decoder_svc.whisper.options import WhisperJob, parse_whisper_options
from shared.errors import InvalidRequestError

SAMPLE_RATE = 16000
# Whisper's input window: 30 s of 16 kHz samples (WhisperFeatureExtractor's n_samples = chunk_length 30 x
# sampling_rate), encoded as 1500 positions. Longer audio is decoded window by window.
WINDOW_S = 30
WINDOW_SAMPLES = WINDOW_S * SAMPLE_RATE
# An HF fast tokenizer sets truncation on its shared Rust backend for every call, so concurrent calls
# (requests are parsed on a thread pool) with and without truncation would see each other's setting.
_TOKENIZER_LOCK = threading.Lock()
_AUDIO, _TEXT = ("audio", "pcm"), ("text", "input_ids")


@dataclass
class RequestInput:
    """One request's encoder input and decoder prompt.

    Attributes:
        encoder_len: cross-attention KV length of one window (source tokens, or
            Whisper's 1500 positions per 30 s window).
        pcm: ``[N]`` float32 at 16 kHz (audio models), else None: the whole clip,
            or one long-form window's samples (``decoder_svc.session.whisper_session``).
        input_ids: source token ids (text models), else None.
        prompt_token_ids: decoder prompt; None = the model's default.
        applied: generation defaults in effect, reported on the last response.
    """

    encoder_len: int
    pcm: np.ndarray | None = None
    input_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    applied: list[str] = field(default_factory=list)
    whisper: WhisperJob | None = None  # Whisper with n = 1, num_beams = 1: language, task, long-form (its session)
    features: np.ndarray | None = None  # [num_mel_bins, 3000] float32 sent instead of pcm (a long-form window)

    def encoder_source(self) -> dict:
        """The encoder input as Encode sends it and the encoder cache keys it: ``{"input_ids": [...]}``
        (source token ids), ``{"features": bytes}`` (``[num_mel_bins, 3000]`` float32 little-endian log-mel) or
        ``{"pcm": bytes}`` (float32 little-endian samples at 16 kHz)."""
        if self.input_ids is not None:
            return {"input_ids": list(self.input_ids)}
        if self.features is not None:
            return {"features": self.features.astype("<f4").tobytes()}
        return {"pcm": self.pcm.astype("<f4").tobytes()}


def decode_request_audio(request, limits: AudioLimits) -> np.ndarray:
    """The audio of a request whose input is ``audio`` (a file) or ``pcm`` (raw samples), as
    ``[num_samples]`` float32 at 16 kHz (``decoder_svc.session.audio``).

    Raises:
        decoder_svc.session.audio.AudioError: (a ``ValueError``, INVALID_ARGUMENT) undecodable, or over
            ``limits`` (judged from the header where it states them, else while decoding, which stops there).
    """
    if request.WhichOneof("input") == "audio":
        return decode_audio(request.audio, limits=limits)
    pcm = request.pcm
    return pcm_to_array(pcm.samples, pcm.sample_rate, encoding=pcm.encoding, limits=limits)


def parse_input(
    request,
    model,
    tokenizer,
    max_audio_s: float,
    decoding_rules: str = "openai",
    pcm: np.ndarray | None = None,
    limits: AudioLimits | None = None,
) -> RequestInput:
    """Validates and converts ``request.input`` (and the decoder prompt) for ``model``.

    Args:
        max_audio_s: longest accepted audio in seconds (``--max-audio-s``);
            audio longer than 30 s is accepted up to it and decoded in windows.
        decoding_rules: Whisper's decoding rules for a request that names none (``--decoding-rules``).
        pcm: the request's audio already decoded (``decode_request_audio``, on the service's decode
            pool); None = decode it here.
        limits: the accepted audio when decoding here (default: ``max_audio_s`` and the default rate and
            channel limits).

    Raises:
        InvalidRequestError: missing input, input of the wrong kind for the
            model, undecodable audio, audio longer than ``max_audio_s`` (the
            message names its length and the limit), a source longer than the
            model's max source positions without ``truncate``, ids out of range.
        decoder_svc.session.audio.AudioError: (a ``ValueError``, also INVALID_ARGUMENT)
            undecodable audio, or audio longer than ``max_audio_s`` judged
            from the header / sample count before decoding.
    """
    kind = request.WhichOneof("input")
    text_model = getattr(model, "input_modality", "audio") == "text"
    if kind is None:
        want = "`text` or `input_ids`" if text_model else "`audio` (an audio file's bytes) or `pcm`"
        raise InvalidRequestError(f"request has no input: set {want}")
    if text_model and kind in _AUDIO:
        raise InvalidRequestError(f"this model translates text: set `text` or `input_ids`, not `{kind}`")
    if not text_model and kind in _TEXT:
        raise InvalidRequestError(f"this model transcribes audio: set `audio` or `pcm`, not `{kind}`")
    if request.WhichOneof("decoder_prompt") and not text_model:
        raise InvalidRequestError("decoder_prompt_* is for text models; this model uses its own audio prompt")
    if not text_model:
        if pcm is None:  # the duration is checked from the header / sample count before decoding, where known
            pcm = decode_request_audio(request, limits or AudioLimits(max_audio_s))
        seconds = len(pcm) / SAMPLE_RATE
        if seconds > max_audio_s:
            raise InvalidRequestError(f"audio is {seconds:.2f} s long; this server accepts at most {max_audio_s:.2f} s")
        sampling = request.sampling
        if max(sampling.n, sampling.num_beams) > 1 and len(pcm) > WINDOW_SAMPLES:
            raise InvalidRequestError(
                "sampling.n > 1 / num_beams > 1 are not supported for audio over 30 s "
                "(decoded long-form, window by window); send n=1 and num_beams=1, or a shorter clip"
            )
        job = None
        if max(sampling.n, sampling.num_beams, 1) == 1:
            job = parse_whisper_options(
                request.whisper,
                model.generation.specials,
                lambda text: encode_text(tokenizer, text, add_special_tokens=False),
                pcm,
                sampling,
                model.config.num_mel_bins,
                decoding_rules,
            )
        elif request.HasField("whisper") and request.whisper != type(request.whisper)():
            raise InvalidRequestError(
                "whisper options (language, task, prompt, timestamps, long-form, VAD) need sampling.n = 1 and "
                "num_beams = 1"
            )
        return RequestInput(encoder_len=model.config.max_source_positions, pcm=pcm, whisper=job)
    return _text_input(request, kind, model, tokenizer)


def _text_input(request, kind: str, model, tokenizer) -> RequestInput:
    c, gen = model.config, model.generation
    ids = encode_text(tokenizer, request.text) if kind == "text" else list(request.input_ids.ids)
    if not ids:
        raise InvalidRequestError("the source is empty" + (" after tokenization" if kind == "text" else ""))
    _check_ids(ids, c.vocab_size, "input_ids")
    max_src = c.max_source_positions
    truncated = len(ids) > max_src
    if truncated:
        if not request.truncate:
            raise InvalidRequestError(
                f"source has {len(ids)} tokens but this model accepts at most {max_src} source positions; "
                "shorten it or set truncate=true"
            )
        # Text is cut by the tokenizer, as HF `tokenizer(text, truncation=True, max_length=...)` does: the
        # special tokens (end token, mBART's language code) stay. `input_ids` are used as given: cut at the end.
        ids = (
            encode_text(tokenizer, request.text, truncation=True, max_length=max_src)
            if kind == "text"
            else ids[:max_src]
        )
    prompt_kind = request.WhichOneof("decoder_prompt")
    prefix: list[int] = []
    if prompt_kind == "decoder_prompt_text":
        prefix = encode_text(tokenizer, request.decoder_prompt_text, add_special_tokens=False)
    elif prompt_kind == "decoder_prompt_ids":
        prefix = list(request.decoder_prompt_ids.ids)
        _check_ids(prefix, c.vocab_size, "decoder_prompt_ids")
    applied = gen.applied() + ([f"truncated_source={len(ids)}"] if truncated else [])
    return RequestInput(
        encoder_len=len(ids), input_ids=ids, prompt_token_ids=[gen.decoder_start_token_id, *prefix], applied=applied
    )


def encode_text(tokenizer, text: str, **kwargs) -> list[int]:
    with _TOKENIZER_LOCK:
        return list(tokenizer(text, verbose=False, **kwargs)["input_ids"])


def _check_ids(ids: list[int], vocab: int, name: str) -> None:
    bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"{name} must be in [0, {vocab}) (the model's vocabulary size): {name}[{bad[0]}] is {bad[1]}"
        )
