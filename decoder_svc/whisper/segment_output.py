"""An accepted long-form window -> its stream message: segments (text, times in the original audio), words.

Times: ``LongFormState`` gives seconds in the audio the model saw; with VAD
that is the speech regions joined, so every start / end goes through
``WhisperJob.original_time`` (faster-whisper's ``SpeechTimestampsMap``).
Words (``timestamps=word``): the window's tokens are aligned once over its
kept cross-attention KV (``shared.models.whisper_alignment``), grouped into
words (``decoder_svc.whisper.word_timing.find_words``) and handed to the
segments in token order (a word belongs to the segment holding its first
token).
"""

from __future__ import annotations

import math

import torch

from decoder_svc.whisper.segments import Segment
from decoder_svc.whisper.word_timing import WordTiming, find_words
from shared.models.whisper_alignment import alignment_weights
from shared.proto import decoder_pb2


def segment_messages(
    request_id: str,
    job,
    tokenizer,
    segments: list[Segment],
    words: list[list[WordTiming]] | None,
    first_id: int,
) -> decoder_pb2.GenerateResponse:
    """One ``GenerateResponse`` with the window's segments and their text as the text delta.

    Args:
        job: the request's ``decoder_svc.whisper.options.WhisperJob`` (specials, time map).
        segments: the window's accepted segments (``LongFormState``), text not yet decoded.
        words: per segment its words (``window_words``), or None.
        first_id: the id of the first segment (segments are numbered over the request). The text delta is
            the segments' texts concatenated: each carries its own leading space, as HF joins them.

    Returns:
        The message; segments with no text (a window of timestamps only) are left out.
    """
    specials = job.specials
    message = decoder_pb2.GenerateResponse(request_id=request_id)
    for i, seg in enumerate(segments):
        text = tokenizer.decode(specials.text_tokens(seg.tokens), skip_special_tokens=True)
        seg.text = text
        if not text.strip():
            continue
        start, end = job.speech_span(seg.start, seg.end)  # not into the silence the gate padded a clip with
        pb = message.segments.add(
            id=first_id + len(message.segments),
            seek=seg.seek,
            start=job.original_time(start),
            end=job.original_time(end),
            text=text,
            tokens=seg.tokens,
            avg_logprob=_num(seg.avg_logprob),
            compression_ratio=_num(seg.compression_ratio),
            no_speech_prob=_num(seg.no_speech_prob),
            temperature=_num(seg.temperature),
        )
        for w in words[i] if words is not None else ():
            w_start, w_end = job.speech_span(w.start, w.end)  # a first word timed from the window's lead-in
            if (start, end) != (seg.start, seg.end):  # the segment was cut to the speech: its words with it
                w_start, w_end = min(max(w_start, start), end), min(max(w_end, start), end)
            pb.words.add(
                word=w.word, start=job.original_time(w_start), end=job.original_time(w_end), probability=w.probability
            )
        message.text += text
    return message


def window_words(
    model, tokenizer, job, plan, segments, generated, logprobs, cross_kv, language: str | None
) -> list[list[WordTiming]]:
    """Per segment of an accepted window, its words (seconds in the audio the model saw).

    Args:
        model: the decoder's Whisper model. plan: the window's ``longform.WindowPlan``.
        generated: the window's generated ids; logprobs: one per generated id (natural log).
        cross_kv: ``[L, 2, 1500, H, Dh]`` the window's cross-attention KV (``DecoderEngine.cross_kv``).
        language: the request's language (languages without spaces split per character).

    Returns:
        ``len(segments)`` lists of ``WordTiming``.
    """
    specials = job.specials
    decoded = list(generated)
    prompt, generated = alignment_sequence(job, list(plan.prompt_ids), plan.sot_index, decoded)
    token_ids = (prompt + generated)[: model.config.max_target_positions]
    generated = token_ids[len(prompt) :]
    weights = alignment_weights(model, token_ids, cross_kv.to(torch.float32), specials.alignment_heads)
    if job.rules.openai:  # each text token's own probability; the closing <|endoftext|>'s is never read
        text_probs = [math.exp(lp) for t, lp in zip(decoded, logprobs) if t < specials.eot]
        probs = (text_probs + [1.0])[: len(generated)]
    else:
        probs = [math.exp(lp) for lp in logprobs[: len(generated)]]
    found = find_words(
        tokenizer,
        specials,
        token_ids,
        len(prompt),
        probs,
        weights,
        plan.num_frames,
        plan.time_offset,
        language,
    )
    per_segment: list[list[WordTiming]] = [[] for _ in segments]
    counts = [len(specials.text_tokens(s.tokens)) for s in segments]
    seg, used = 0, 0
    for w in found:
        while seg < len(segments) - 1 and used >= counts[seg]:
            seg, used = seg + 1, 0
        per_segment[seg].append(w)
        used += len(w.tokens)
    return per_segment


def alignment_sequence(job, prompt: list[int], sot_index: int, generated: list[int]) -> tuple[list[int], list[int]]:
    """The ``(prompt, rest)`` whose cross-attention times a window's words.

    ``"openai"`` rules: openai-whisper's ``timing.find_alignment`` (faster-whisper's too): the window's
    ``<|startoftranscript|>`` sequence (language, task), ``<|notimestamps|>``, then its text tokens and
    ``<|endoftext|>``: no previous text, no timestamp tokens (about a third of the tokens a conditioned window's
    decode held, so a third of the recompute). ``"hf"`` rules: HF's ``_extract_token_timestamps`` sequence, the
    decoder prompt and every generated token (``word_timing``'s module docstring).

    Args:
        job: the request's ``WhisperJob`` (its rules and special tokens).
        prompt: the window's decoder prompt; sot_index: its ``<|startoftranscript|>`` (``WindowPlan.sot_index``).
        generated: its generated ids.
    """
    specials = job.specials
    if not job.rules.openai:
        return prompt, generated
    sot = [t for t in prompt[sot_index:] if t != specials.no_timestamps]  # a prompt without timestamps ends with it
    return [*sot, specials.no_timestamps], specials.text_tokens(generated) + [specials.eot]


def _num(x: float | None) -> float:
    return 0.0 if x is None else float(x)
