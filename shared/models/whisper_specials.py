"""Whisper's special tokens and decoder prompts (language, task, timestamps, previous text).

The token layout is openai-whisper's ``tokenizer.py`` / HF ``WhisperTokenizer``:
``<|endoftext|>``, ``<|startoftranscript|>``, one token per language
(``<|en|>`` ...), ``<|translate|>``, ``<|transcribe|>``, ``<|startoflm|>``,
``<|startofprev|>``, ``<|nospeech|>`` (``<|nocaptions|>`` in English-only
checkpoints), ``<|notimestamps|>``, then 1501 timestamp tokens ``<|0.00|>`` ..
``<|30.00|>`` in steps of 0.02 s. English-only checkpoints have vocabulary
51864, multilingual ones 51865 and up (HF ``is_multilingual``).

The decoder prompt is HF ``generate``'s ``init_tokens`` (``_retrieve_init_tokens``)
with the previous text in front as ``_prepare_decoder_input_ids`` puts it:
``[<|startofprev|>, *previous[-(max_target_positions // 2 - 1):]]`` +
``[<|startoftranscript|>, <|lang|>, <|task|>]`` (multilingual only) +
``[<|notimestamps|>]`` unless timestamps are predicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TIME_PRECISION = 0.02  # seconds per timestamp token (openai-whisper / HF time_precision)
# HF WhisperTimeStampLogitsProcessor: max_initial_timestamp_index = 50 (the first timestamp <= 1.0 s),
# from generation_config.json of the openai/whisper-* checkpoints.
MAX_INITIAL_TIMESTAMP_INDEX = 50
MULTILINGUAL_MIN_VOCAB = 51865  # HF: is_multilingual = vocab_size >= 51865


def language_code(language: str) -> str:
    """An ISO code from what a user sends: a code as given (``" DE "`` -> ``"de"``), an English name or alias
    as its code (``"German"`` -> ``"de"``, HF ``tokenization_whisper.TO_LANGUAGE_CODE``); anything else lower-cased
    as is, for ``WhisperSpecials.check`` to refuse naming what the model knows; ``""`` stays ``""``."""
    language = language.strip().lower()
    if not language:
        return ""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    return TO_LANGUAGE_CODE.get(language, language)


class WhisperLanguageError(ValueError):
    """A language or task the checkpoint cannot do; the message lists what it can."""


@dataclass(frozen=True)
class WhisperSpecials:
    """One checkpoint's special token ids.

    Attributes:
        eot: ``<|endoftext|>`` (the end token). sot: ``<|startoftranscript|>``.
        sot_prev: ``<|startofprev|>``. no_speech: ``<|nospeech|>`` / ``<|nocaptions|>``
            (= ``no_timestamps - 1``, HF's no_speech_token). no_timestamps: ``<|notimestamps|>``.
        timestamp_begin: ``<|0.00|>`` (= ``no_timestamps + 1``); token ``timestamp_begin + i`` is ``i * 0.02`` s.
        transcribe / translate: task tokens. languages: ISO code (``"en"``) -> language token id,
            empty for English-only checkpoints.
        vocab_size: the model's vocabulary (timestamp tokens end at ``vocab_size - 1``).
        alignment_heads: ``(layer, head)`` decoder cross-attention heads used for word timestamps.
        max_target_positions: decoder positions (448).
    """

    eot: int
    sot: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    transcribe: int
    translate: int
    vocab_size: int
    languages: Mapping[str, int] = field(default_factory=dict)
    alignment_heads: tuple[tuple[int, int], ...] = ()
    max_target_positions: int = 448

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def multilingual(self) -> bool:
        return self.vocab_size >= MULTILINGUAL_MIN_VOCAB and bool(self.languages)

    @property
    def language_ids(self) -> list[int]:
        return list(self.languages.values())

    def language_code(self, token_id: int) -> str:
        """``"de"`` for ``<|de|>``'s id. Raises KeyError for another id."""
        for code, tid in self.languages.items():
            if tid == token_id:
                return code
        raise KeyError(token_id)

    def is_timestamp(self, token_id: int) -> bool:
        return token_id >= self.timestamp_begin

    def timestamp_seconds(self, token_id: int) -> float:
        """Seconds (from the window start) of a timestamp token."""
        return (token_id - self.timestamp_begin) * TIME_PRECISION

    def text_tokens(self, token_ids: Iterable[int]) -> list[int]:
        """The ids below ``<|endoftext|>`` (text tokens; specials and timestamps dropped)."""
        return [t for t in token_ids if t < self.eot]

    def check(self, language: str | None, task: str) -> None:
        """Refuses what the checkpoint cannot do.

        Args:
            language: ISO code, or None (detect).
            task: ``"transcribe"`` or ``"translate"``.

        Raises:
            WhisperLanguageError: unknown task; translate or a non-English language on an
                English-only checkpoint; a language the checkpoint has no token for.
        """
        if task not in ("transcribe", "translate"):
            raise WhisperLanguageError(f"task must be 'transcribe' or 'translate', got {task!r}")
        if not self.multilingual:
            if task == "translate":
                raise WhisperLanguageError("this model is English-only: it cannot translate; use a multilingual model")
            if language not in (None, "en"):
                raise WhisperLanguageError(
                    f"this model is English-only: language must be 'en' or empty, got {language!r}"
                )
            return
        if language is not None and language not in self.languages:
            raise WhisperLanguageError(
                f"unknown language {language!r}; this model knows: {', '.join(sorted(self.languages))}"
            )

    def decoder_prompt(
        self,
        language: str | None = "en",
        task: str = "transcribe",
        timestamps: bool = False,
        previous: Iterable[int] = (),
    ) -> list[int]:
        """The decoder prompt of one window.

        Args:
            language: ISO code (multilingual checkpoints); ignored by English-only ones.
                None stops the prompt at ``<|startoftranscript|>`` (language detection's prompt).
            task: ``"transcribe"`` / ``"translate"``.
            timestamps: False appends ``<|notimestamps|>``.
            previous: text token ids of the initial prompt / previous windows; the last
                ``max_target_positions // 2 - 1`` (223) are kept (HF's cut-off).

        Returns:
            Token ids; ``prompt.index(self.sot)`` is where HF reads ``no_speech_prob``.

        Raises:
            WhisperLanguageError: see ``check``.
        """
        self.check(language, task)
        prev = list(previous)
        out: list[int] = []
        if prev:
            keep = self.max_target_positions // 2 - 1
            out = [self.sot_prev, *prev[-keep:]]
        out.append(self.sot)
        if language is None and self.multilingual:
            return out
        if self.multilingual:
            out += [self.languages[language], self.translate if task == "translate" else self.transcribe]
        if not timestamps:
            out.append(self.no_timestamps)
        return out

    @classmethod
    def from_token_ids(
        cls,
        ids: Mapping[str, int],
        vocab_size: int,
        language_ids: Iterable[int] | None = None,
        alignment_heads: Iterable[Iterable[int]] = (),
        max_target_positions: int = 448,
    ) -> WhisperSpecials:
        """From a ``content -> id`` map of the tokenizer's special tokens.

        Args:
            ids: e.g. ``shared.models.whisper_features.special_token_ids(model_dir)``.
            language_ids: the checkpoint's language token ids (CTranslate2 ``lang_ids``,
                HF ``lang_to_id.values()``); None = every ``<|xx|>`` token between
                ``<|startoftranscript|>`` and ``<|translate|>``.

        Raises:
            KeyError: a required special token is missing.
        """
        names = {v: k for k, v in ids.items()}
        sot, translate = ids["<|startoftranscript|>"], ids["<|translate|>"]
        if language_ids is None:
            language_ids = [i for i in range(sot + 1, translate) if i in names]
        no_ts = ids["<|notimestamps|>"]
        multilingual = vocab_size >= MULTILINGUAL_MIN_VOCAB
        languages = {names[i][2:-2]: int(i) for i in language_ids if i in names} if multilingual else {}
        return cls(
            eot=ids["<|endoftext|>"],
            sot=sot,
            sot_prev=ids["<|startofprev|>"],
            no_speech=ids.get("<|nospeech|>", ids.get("<|nocaptions|>", no_ts - 1)),
            no_timestamps=no_ts,
            transcribe=ids["<|transcribe|>"],
            translate=translate,
            vocab_size=vocab_size,
            languages=languages,
            alignment_heads=tuple((int(a), int(b)) for a, b in alignment_heads),
            max_target_positions=max_target_positions,
        )
