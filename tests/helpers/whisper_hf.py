"""HF transformers references for the Whisper end-to-end tests, and the clips they run on.

``load_hf_whisper(name)`` wraps ``encdec.bench.hf_whisper.build_hf_whisper`` (HF
``WhisperForConditionalGeneration`` holding the served CTranslate2 weights) with the
generation config HF's own checkpoints ship and the server follows: ``prev_sot_token_id``
(``<|startofprev|>``), ``max_initial_timestamp_index`` 50, ``alignment_heads``, and for
multilingual checkpoints every language in ``lang_to_id`` and both tasks in ``task_to_id``.
Every method runs HF's ``generate`` / ``detect_language`` (greedy, float32, CPU) on a deep copy
of that config, so calls never leak settings into each other.

Word times (``hf_word_times``) follow ``decoder_svc/whisper/word_timing.py``: a word starts at the
time of the token before its first token and ends at the time of its last token; punctuation merged
into a word leaves the word's own times (openai-whisper ``merge_punctuations``).

Clips are 16 kHz float32 mono: the bundled English ones (``encdec/data``), the espeak-ng
weather reports (``tests/data/speech``), and clips built from them with numpy only.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from encdec import DATA_DIR

RATE = 16_000
SPEECH_DIR = Path(__file__).resolve().parents[1] / "data" / "speech"
ENGLISH_CLIPS = ("sample", "meeting", "weather", "numbers", "short")
LONGFORM_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper transcribe() / the server's defaults
# openai-whisper transcribe() defaults: marks merged into the previous / next word (as word_timing.py's).
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
PREPEND_PUNCTUATIONS = "\"'“¿([{-"


def read_clip(name: str) -> np.ndarray:
    """``[N]`` float32 16 kHz: ``"sample"`` .. ``"short"`` from ``encdec/data``, ``"weather_de"``, ``"museum_fr"``
    etc. from ``tests/data/speech``.

    Raises:
        AssertionError: the file is not 16 kHz mono.
    """
    path = SPEECH_DIR / f"{name}.wav" if (SPEECH_DIR / f"{name}.wav").exists() else DATA_DIR / f"{name}.wav"
    pcm, rate = sf.read(path, dtype="float32")
    assert rate == RATE and pcm.ndim == 1, (path, rate, pcm.shape)
    return pcm


def joined_clip(rounds: int, seed: int, min_gap_s: float = 0.5, max_gap_s: float = 2.0) -> np.ndarray:
    """``[N]`` float32: the bundled English clips, ``rounds`` times, each round in a shuffled order, each clip
    followed by ``uniform(min_gap_s, max_gap_s)`` seconds of digital silence (``numpy.random.default_rng(seed)``,
    so the same arguments give the same samples). Five rounds are about 160 s."""
    rng = np.random.default_rng(seed)
    clips = {n: read_clip(n) for n in ENGLISH_CLIPS}
    parts = []
    for _ in range(rounds):
        for i in rng.permutation(len(ENGLISH_CLIPS)):
            parts.append(clips[ENGLISH_CLIPS[i]])
            parts.append(np.zeros(int(rng.uniform(min_gap_s, max_gap_s) * RATE), np.float32))
    return np.concatenate(parts)


def noise(seconds: float, dbfs: float, seed: int = 0) -> np.ndarray:
    """``[seconds * 16000]`` float32 gaussian noise whose RMS is ``dbfs`` decibels below full scale (1.0)."""
    rms = 10.0 ** (dbfs / 20.0)
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * rms).astype(np.float32)


@dataclass(frozen=True)
class HfSegment:
    """One HF segment: ``seek`` (mel frame of its window's start), ``start`` / ``end`` seconds (float64), its ids
    with their timestamp tokens, and (word timestamps only) per id: ``token_times``, HF's ``token_timestamps``
    (DTW over the generated tokens' rows: the window's first generated token is always 0.0), and
    ``openai_token_times``, HF's same ``_extract_token_timestamps`` run from the last prompt token's row on
    (openai-whisper's rows, ``find_alignment``: the first generated token gets its real time)."""

    seek: int
    start: float
    end: float
    tokens: list[int]
    token_times: list[float] | None = None
    openai_token_times: list[float] | None = None


class HfWhisper:
    """HF Whisper on the served weights of ``model_name`` (see the module docstring).

    Attributes:
        model_dir: the served CTranslate2 directory (``model.bin``, ``tokenizer.json``).
        model: the HF ``WhisperForConditionalGeneration`` (eval, float32).
        specials: the served checkpoint's ``WhisperSpecials`` (ids, languages, alignment heads).
        tokenizer: the checkpoint's tokenizer (``shared.models.whisper_features.load_tokenizer``).
    """

    def __init__(self, model_name: str) -> None:
        from encdec.bench.hf_whisper import build_hf_whisper
        from shared.models.registry import resolve_model
        from shared.models.whisper import WhisperForConditionalGeneration
        from shared.models.whisper_features import load_tokenizer

        self.model_dir = model_dir = resolve_model(model_name)[1]
        self.model = build_hf_whisper(model_dir)
        self.specials = sp = WhisperForConditionalGeneration.from_pretrained(model_dir).generation.specials
        self.tokenizer = load_tokenizer(model_dir)
        g = self.model.generation_config
        g.prev_sot_token_id = sp.sot_prev
        g.max_initial_timestamp_index = 50
        g.alignment_heads = [list(h) for h in sp.alignment_heads]
        if sp.multilingual:
            g.lang_to_id = {f"<|{code}|>": tid for code, tid in sp.languages.items()}
            g.task_to_id = {"transcribe": sp.transcribe, "translate": sp.translate}
            g.language = g.task = None  # build_hf_whisper's "en" default would hide detection
        self._attn = self.model.config._attn_implementation
        self._encoded: dict[str, object] = {}
        self._generated: dict[tuple[str, str], object] = {}

    def _config(self):
        return copy.deepcopy(self.model.generation_config)

    @staticmethod
    def features(pcm: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_features [1, 80, 3000], attention_mask [1, 3000])`` of a clip of at most 30 s, as HF's
        ``WhisperFeatureExtractor`` pads it (30 s of zeros after the audio)."""
        fe = _feature_extractor()
        out = fe(pcm, sampling_rate=RATE, return_tensors="pt", return_attention_mask=True)
        return out.input_features, out.attention_mask

    def encode(self, pcm: np.ndarray):
        """HF's encoder output for the 30 s features of ``pcm`` (SDPA attention), computed once per clip: every
        call on the same samples but the word-timestamp one reuses it (``generate`` would compute the same)."""
        key = _clip_key(pcm)
        if key not in self._encoded:
            feats, _ = self.features(pcm)
            with torch.inference_mode():
                self._encoded[key] = self.model.get_encoder()(feats)
        return self._encoded[key]

    def generate(self, pcm: np.ndarray, **kwargs):
        """HF ``generate`` on the 30 s features of ``pcm`` (``torch.inference_mode``); ``kwargs`` go to it.

        ``return_token_timestamps=True`` runs HF's whole pipeline on the features (it switches HF to eager
        attention, switched back afterwards) with the feature extractor's ``attention_mask``; otherwise the
        encoder output comes from ``encode``. Results are kept: the same clip and arguments are decoded once.
        """
        key = (_clip_key(pcm), repr(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in self._generated:
            self._generated[key] = self._generate(pcm, **kwargs)
        return self._generated[key]

    def _generate(self, pcm: np.ndarray, **kwargs):
        if kwargs.get("return_token_timestamps"):
            feats, mask = self.features(pcm)
            inputs = {"input_features": feats, "attention_mask": mask}  # HF crops the cross-attention to the audio
        else:
            inputs = {"encoder_outputs": self.encode(pcm)}
        try:
            with torch.inference_mode():
                return self.model.generate(generation_config=self._config(), **inputs, **kwargs)
        finally:
            self.model.config._attn_implementation = self._attn

    def detect(self, pcm: np.ndarray) -> tuple[str, float]:
        """HF ``detect_language``'s code for ``pcm``, and the softmax over the language tokens (only) of HF's
        raw logits at ``[<|startoftranscript|>]`` at that language.

        Raises:
            KeyError: HF chose an id that is not a language of the checkpoint.
        """
        sp = self.specials
        enc = self.encode(pcm)
        with torch.inference_mode():
            token_id = int(self.model.detect_language(encoder_outputs=enc, generation_config=self._config())[0])
            logits = self.model(encoder_outputs=enc, decoder_input_ids=torch.tensor([[sp.sot]])).logits[0, -1]  # [V]
        ids = torch.tensor(sp.language_ids)
        probs = torch.softmax(logits[ids].float(), dim=-1)  # [num_languages]
        return sp.language_code(token_id), float(probs[sp.language_ids.index(token_id)])

    def prompt_ids(self, prompt: str) -> torch.Tensor:
        """``[1 + T]`` long: HF ``WhisperTokenizerFast.get_prompt_ids(prompt)`` (what ``WhisperProcessor`` hands
        ``generate``): ``<|startofprev|>`` then the tokens of ``" " + prompt.strip()``."""
        from transformers import WhisperTokenizerFast

        hf_tokenizer = WhisperTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        ids = torch.as_tensor(hf_tokenizer.get_prompt_ids(prompt), dtype=torch.long)
        assert int(ids[0]) == self.specials.sot_prev, ids
        return ids

    def _language_task(self, language: str | None, task: str) -> dict:
        # HF appends no task token when neither language nor task is given: name the task always, as the
        # server's prompt <|sot|> <|lang|> <|task|> does (language None = HF detects it first).
        return {"language": language, "task": task} if self.specials.multilingual else {}

    def short_form(
        self, pcm: np.ndarray, language: str | None = None, task: str = "transcribe", prompt: str | None = None
    ) -> list[int]:
        """HF's greedy ids for a clip of at most 30 s, no timestamps (no prompt, no ``<|endoftext|>``: HF strips
        both; ``prompt`` goes in as ``prompt_ids``). ``language`` None: HF detects it (multilingual)."""
        kwargs = {} if prompt is None else {"prompt_ids": self.prompt_ids(prompt)}
        out = self.generate(pcm, **kwargs, **self._language_task(language, task))
        return out[0].tolist() if isinstance(out, torch.Tensor) else out["sequences"][0].tolist()

    def segments(self, pcm: np.ndarray, language: str | None = None, words: bool = False) -> list[HfSegment]:
        """HF ``generate(return_timestamps=True, return_segments=True)`` segments of a clip of at most 30 s;
        ``words`` adds ``return_token_timestamps=True`` (each segment's ``token_times``, seconds)."""
        kwargs = self._language_task(language, "transcribe")
        out = self.generate(pcm, return_timestamps=True, return_segments=True, return_token_timestamps=words, **kwargs)
        hf_segments = out["segments"][0]
        segments = [self._segment(s, words) for s in hf_segments]
        if words and hf_segments:  # one window: every segment shares its generate output ("result")
            num_prompt = int(hf_segments[0]["idxs"][0])
            times = self._token_times_from(hf_segments[0]["result"], int(self.features(pcm)[1].sum()), num_prompt - 1)
            for seg, s in zip(segments, hf_segments, strict=True):
                seg.openai_token_times.extend(times[int(s["idxs"][0]) : int(s["idxs"][1])])
        return segments

    def _token_times_from(self, result: dict, num_frames: int, first_row: int) -> list[float]:
        """HF ``_extract_token_timestamps`` over one window's generate output, DTW from row ``first_row`` on:
        ``[prompt + generated]`` seconds from the window start."""

        class Outputs(dict):  # HF reads the outputs by attribute
            __getattr__ = dict.__getitem__

        outputs = Outputs(cross_attentions=result["cross_attentions"], sequences=result["sequences"][None])
        with torch.inference_mode():
            times = self.model._extract_token_timestamps(
                outputs, self.model.generation_config.alignment_heads, num_frames=num_frames, num_input_ids=first_row
            )
        return times[0].tolist()

    def long_form(self, pcm: np.ndarray, language: str | None = None, seed: int = 0) -> list[HfSegment]:
        """HF's sequential long-form ``generate`` over the whole clip with openai-whisper's defaults.

        Features from ``WhisperFeatureExtractor(truncation=False, padding="longest", return_attention_mask=True)``;
        ``condition_on_prev_tokens=True``, temperatures 0.0 .. 1.0, compression ratio 2.4, logprob -1.0,
        no-speech 0.6; ``torch.manual_seed(seed)`` before (a sampled fallback draws from it).
        """
        fe = _feature_extractor()
        inp = fe(
            pcm,
            sampling_rate=RATE,
            return_tensors="pt",
            truncation=False,
            padding="longest",
            return_attention_mask=True,
        )
        kwargs = self._language_task(language, "transcribe")
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(
                inp.input_features,
                attention_mask=inp.attention_mask,
                generation_config=self._config(),
                return_timestamps=True,
                return_segments=True,
                condition_on_prev_tokens=True,
                temperature=LONGFORM_TEMPERATURES,
                compression_ratio_threshold=2.4,
                logprob_threshold=-1.0,
                no_speech_threshold=0.6,
                **kwargs,
            )
        return [self._segment(s, False) for s in out["segments"][0]]

    def _segment(self, s: dict, words: bool) -> HfSegment:
        tokens = s["tokens"].tolist()
        start = float(s["start"])
        ts0 = self.specials.timestamp_begin
        offset = start - (tokens[0] - ts0) * 0.02 if tokens and tokens[0] >= ts0 else start  # the window's start
        times = s["token_timestamps"].tolist() if words else None
        return HfSegment(round(offset * 100), start, float(s["end"]), tokens, times, [] if words else None)


def _clip_key(pcm: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(pcm, dtype=np.float32).tobytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def _feature_extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=80, sampling_rate=RATE)


def hf_word_times(hf: HfWhisper, segment: HfSegment, words: list[str], window_first: bool) -> list[tuple[float, float]]:
    """Each word's ``(start, end)`` seconds from HF's token times of ``segment`` (``segments(words=True)``).

    Args:
        words: the segment's words in order, their texts concatenating to its text (leading spaces kept).
        window_first: the segment opens its window: its first word starts at the window's first generated token,
            which HF's ``token_timestamps`` always give 0.0; that start is read from ``openai_token_times``.

    Raises:
        AssertionError: the words do not spell the segment's text tokens, or the segment opens without a timestamp.
    """
    tok, ids = hf.tokenizer, segment.tokens
    assert ids and ids[0] >= hf.specials.timestamp_begin, ids  # a token before every word
    positions = [i for i, t in enumerate(ids) if t < hf.specials.eot]  # the text tokens
    out, begin, joined = [], 0, ""
    for k, word in enumerate(words):
        joined += word
        end = begin + 1  # the shortest run of tokens that spells the words so far
        while tok.decode([ids[i] for i in positions[:end]]) != joined:
            end += 1
            assert end <= len(positions), (words, tok.decode([ids[i] for i in positions]))
        first, last = begin, end - 1
        while last > first and tok.decode([ids[positions[last]]]) in APPEND_PUNCTUATIONS:
            last -= 1  # a trailing mark merged into the word
        while first < last and (piece := tok.decode([ids[positions[first]]])).startswith(" "):
            if piece.strip() not in PREPEND_PUNCTUATIONS:
                break
            first += 1  # a leading mark merged into the word
        start_at = positions[first] - 1
        starts = segment.openai_token_times if window_first and k == 0 else segment.token_times
        out.append((starts[start_at], segment.token_times[positions[last]]))
        begin = end
    assert begin == len(positions), (words, ids)
    return out


def load_hf_whisper(model_name: str) -> HfWhisper:
    """``HfWhisper(model_name)``: ``"whisper-tiny.en"`` or ``"whisper-base"``."""
    return HfWhisper(model_name)
