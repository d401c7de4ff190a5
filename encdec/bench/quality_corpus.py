"""The quality bench's corpus: synthetic recordings with reference texts, built from espeak-ng voices and sox.

No PyPI package carries real speech (notes/facts.md), so the corpus is made here, deterministically, by
``encdec.bench.quality_synth`` (espeak-ng speech resampled by sox; pauses, gaps and noise from numpy). Each
subset draws from its own generator, seeded by ``(seed, its index in SUBSETS)``, so a subset's files are the
same bytes whichever other subsets are built with it. Subsets (``SUBSETS``):

* ``clean``: short clips (2-3 sentences) in eight English voices at 120-180 words per minute.
* ``pauses``: 85-110 s readings (16-20 sentences) with pauses of 0.3-5 s, sentences crossing the 30 s
  window boundaries.
* ``long``: 2.5 and 5 minute readings (short pauses); ``long-1`` is the corpus's longest file.
* ``gaps``: long readings broken by silence of 10-60 s (digital silence, and a faint noise floor 45 dB under
  the speech), the classic trigger of invented text.
* ``noise``: speech under white, brown and babble noise (six other voices talking at once) at 20, 10 and
  5 dB SNR, the noise over the whole file.
* ``noise-only``: speech with stretches of white and brown noise alone, 20 dB under the speech.
* ``lang-de``, ``lang-es``, ``lang-fr``: four voices at 115-175 words per minute: a short clip, a 40 s
  reading that starts with 2 s of silence, a fast short clip and a slow 45 s reading (multilingual
  checkpoints only; the bench detects their language as a user's request would).

Each file records its reference text and its ``gaps`` (silence and noise-only stretches, seconds), where a
transcript should have no words. ``build_corpus`` writes ``corpus.json`` and the WAV files into a folder
named by a hash of everything that shapes them, so a second run reuses it (and adds subsets it lacks).

Needs ``espeak-ng`` and ``sox`` on PATH (Debian: ``apt-get install -y espeak-ng sox``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from encdec.bench.quality_synth import SAMPLE_RATE, Layout, Speaker, noise, power

SEED = 31
SUBSETS = ("clean", "pauses", "long", "gaps", "noise", "noise-only", "lang-de", "lang-es", "lang-fr")
ENGLISH_VOICES = (  # (espeak-ng voice, words per minute)
    ("en-us", 140),
    ("en-gb", 160),
    ("en-us+f3", 130),
    ("en-gb-scotland", 150),
    ("en-gb-x-rp+m3", 175),
    ("en-029", 120),
    ("en-us+m5", 180),
    ("en-gb+f2", 145),
)
LANGUAGE_VOICES = {  # per language: the short clip's, the reading's, the fast clip's and the slow reading's voice
    "de": (("de", 130), ("de+f2", 150), ("de+m3", 175), ("de+f4", 115)),
    "es": (("es", 130), ("es-419+f3", 150), ("es+m3", 175), ("es-419+f4", 115)),
    "fr": (("fr-fr", 130), ("fr-be+m3", 150), ("fr-ch+m1", 175), ("fr-fr+f4", 115)),
}
NOISE_SNR_DB = (20, 10, 5)
NOISES = ("white", "brown", "babble")
GAP_LAYOUTS = (  # the gaps subset: ("speech", target_s) and ("gap", seconds, kind), in order
    [("speech", 30), ("gap", 10, "silence"), ("speech", 30), ("gap", 25, "silence"), ("speech", 25)],
    [("speech", 25), ("gap", 40, "faint-noise"), ("speech", 30), ("gap", 60, "silence"), ("speech", 20)],
    [
        ("speech", 20),
        ("gap", 15, "silence"),
        ("speech", 30),
        ("gap", 30, "faint-noise"),
        ("speech", 25),
        ("gap", 50, "silence"),
        ("speech", 20),
    ],
)
NOISE_ONLY_LAYOUT = [
    ("speech", 15),
    ("gap", 20, "white-noise"),
    ("speech", 15),
    ("gap", 30, "brown-noise"),
    ("speech", 15),
]


@dataclass
class CorpusFile:
    """One recording of the corpus.

    Attributes:
        name: file stem (``<subset>-<n>``); the WAV is ``<name>.wav`` beside ``corpus.json``.
        subset: one of ``SUBSETS``. language: ISO 639-1 code of the speech.
        reference: the sentences read, joined by spaces (what WER compares with).
        seconds: length of the audio.
        gaps: ``[start_s, end_s, kind]`` stretches without speech of at least 10 s (``silence``,
            ``faint-noise``, ``white-noise``, ``brown-noise``), where a transcript should have no words.
        sentences: ``[start_s, end_s]`` of each sentence read, in order.
    """

    name: str
    subset: str
    language: str
    reference: str
    seconds: float
    gaps: list[list] = field(default_factory=list)
    sentences: list[list[float]] = field(default_factory=list)


def _file(name, subset, language, pcm, texts, spans, gaps=()) -> tuple[CorpusFile, np.ndarray]:
    peak = float(np.max(np.abs(pcm))) if len(pcm) else 0.0
    if peak > 0.99:  # noise mixed in may pass full scale: scale the whole file down, never clip
        pcm = pcm * (0.99 / peak)
    meta = CorpusFile(name, subset, language, " ".join(texts), len(pcm) / SAMPLE_RATE, [list(g) for g in gaps], spans)
    return meta, pcm.astype(np.float32)


def _subset(subset: str, lay: Layout) -> Iterator[tuple[CorpusFile, np.ndarray]]:
    """The recordings of one subset (see the module docstring), in order."""
    if subset == "clean":
        for i, (voice, speed) in enumerate(ENGLISH_VOICES):
            yield _file(f"clean-{i}", subset, "en", *lay.reading("en", voice, speed, (0.3, 0.8), count=2 + i % 2))
    elif subset == "pauses":
        for i, (pause_s, count) in enumerate((((1.5, 3.5), 16), ((0.3, 5.0), 16), ((0.3, 2.0), 20))):
            voice, speed = ENGLISH_VOICES[(2 * i) % len(ENGLISH_VOICES)]
            yield _file(f"pauses-{i}", subset, "en", *lay.reading("en", voice, speed, pause_s, count=count))
    elif subset == "long":
        for i, target in enumerate((150, 300)):
            voice, speed = ENGLISH_VOICES[(3 * i + 1) % len(ENGLISH_VOICES)]
            yield _file(f"long-{i}", subset, "en", *lay.reading("en", voice, speed, (0.3, 2.0), target_s=target))
    elif subset == "gaps":
        for i, layout in enumerate(GAP_LAYOUTS):
            voice, speed = ENGLISH_VOICES[(5 * i + 2) % len(ENGLISH_VOICES)]
            yield _file(f"gaps-{i}", subset, "en", *lay.with_gaps(layout, "en", voice, speed))
    elif subset == "noise":
        for i, (kind, snr) in enumerate((k, s) for k in NOISES for s in NOISE_SNR_DB):
            voice, speed = ENGLISH_VOICES[i % len(ENGLISH_VOICES)]
            pcm, texts, spans = lay.reading("en", voice, speed, (0.3, 1.2), count=4)
            babble = lay.speak.babble(ENGLISH_VOICES) if kind == "babble" else None
            scale = np.float32(np.sqrt(power(pcm) / 10 ** (snr / 10)))  # noise power = speech power - snr dB
            pcm = pcm + noise(kind, len(pcm), lay.rng, babble) * scale
            yield _file(f"noise-{kind}-{snr}db", subset, "en", pcm, texts, spans)
    elif subset == "noise-only":
        voice, speed = ENGLISH_VOICES[3]
        yield _file("noise-only-0", subset, "en", *lay.with_gaps(NOISE_ONLY_LAYOUT, "en", voice, speed))
    elif subset.startswith("lang-") and subset[5:] in LANGUAGE_VOICES:
        language, voices = subset[5:], LANGUAGE_VOICES[subset[5:]]
        yield _file(f"{subset}-0", subset, language, *lay.reading(language, *voices[0], (0.4, 0.8), count=2))
        pcm, texts, spans = lay.reading(language, *voices[1], (0.5, 3.0), target_s=36)
        lead = 2.0  # seconds of silence before the first word (under the 10 s of a gap)
        pcm = np.concatenate([np.zeros(int(lead * SAMPLE_RATE), np.float32), pcm])
        yield _file(f"{subset}-1", subset, language, pcm, texts, [[s + lead, e + lead] for s, e in spans])
        yield _file(f"{subset}-2", subset, language, *lay.reading(language, *voices[2], (0.3, 0.8), count=3))
        yield _file(f"{subset}-3", subset, language, *lay.reading(language, *voices[3], (0.3, 2.0), target_s=45))
    else:
        raise ValueError(f"unknown subset {subset!r}; choose from {', '.join(SUBSETS)}")


def corpus_files(tmp: Path, seed: int = SEED, subsets: Iterable[str] = SUBSETS):
    """Yields ``(CorpusFile, pcm)`` for every recording of ``subsets`` (in ``SUBSETS`` order); ``pcm``: ``[N]``
    float32 at 16 kHz. ``tmp``: a scratch folder for espeak-ng's and sox's files.

    Raises:
        ValueError: an unknown subset.
    """
    subsets = list(subsets)
    unknown = [s for s in subsets if s not in SUBSETS]
    if unknown:
        raise ValueError(f"unknown subset(s) {unknown}; choose from {', '.join(SUBSETS)}")
    speaker = Speaker(tmp)
    for index, subset in enumerate(SUBSETS):
        if subset in subsets:
            yield from _subset(subset, Layout(speaker, np.random.default_rng([seed, index])))


def _tool_versions() -> str:
    out = []
    for cmd in (["espeak-ng", "--version"], ["sox", "--version"]):
        if shutil.which(cmd[0]) is None:
            raise RuntimeError(
                f"{cmd[0]} not found: the quality corpus needs espeak-ng and sox "
                "(Debian: apt-get install -y espeak-ng sox)"
            )
        out.append(subprocess.run(cmd, capture_output=True, text=True).stdout.strip())
    return "\n".join(out)


def corpus_key(seed: int = SEED) -> str:
    """Hash (12 hex digits) of what shapes the corpus: this module, ``quality_synth``, the sentences, the
    seed, espeak-ng's and sox's versions.

    Raises:
        RuntimeError: espeak-ng or sox is not on PATH.
    """
    from encdec.bench import quality_sentences, quality_synth

    h = hashlib.sha256()
    for path in (Path(__file__), Path(quality_synth.__file__), Path(quality_sentences.__file__)):
        h.update(path.read_bytes())
    h.update(f"{seed}\n{_tool_versions()}".encode())
    return h.hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$ENCDEC_CACHE_DIR``, else ``~/.cache/encdec``."""
    return Path(os.environ.get("ENCDEC_CACHE_DIR", Path.home() / ".cache" / "encdec"))


def build_corpus(root: Path | None = None, seed: int = SEED, subsets: Iterable[str] = SUBSETS) -> Path:
    """Builds (or reuses) the corpus of ``subsets`` under ``root`` (default
    ``$ENCDEC_CACHE_DIR/quality-corpus-<corpus_key>``).

    ``root/corpus.key`` holds the key of the files there: with the same key, subsets already built are kept
    and only missing ones are made (a subset does not depend on the others); with another key or none (an
    older build), the requested subsets are built afresh. About a minute for the whole corpus on 2 cores.

    Returns:
        The folder holding ``corpus.json`` (a list of ``CorpusFile`` fields, in ``SUBSETS`` order) and one
        16 kHz 16-bit WAV per file.

    Raises:
        ValueError: an unknown subset. RuntimeError: espeak-ng or sox missing.
        subprocess.CalledProcessError: either failed.
    """
    import soundfile as sf

    requested = set(subsets)
    if unknown := sorted(requested - set(SUBSETS)):
        raise ValueError(f"unknown subset(s) {unknown}; choose from {', '.join(SUBSETS)}")
    subsets = [s for s in SUBSETS if s in requested]
    key = corpus_key(seed)
    root = Path(root) if root is not None else default_cache_dir() / f"quality-corpus-{key}"
    index, key_file = root / "corpus.json", root / "corpus.key"
    fresh = index.exists() and key_file.exists() and key_file.read_text().strip() == key
    files = json.loads(index.read_text()) if fresh else []
    missing = [s for s in subsets if s not in {f["subset"] for f in files}]
    if not missing:
        return root
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="encdec-corpus-") as tmp:
        for meta, pcm in corpus_files(Path(tmp), seed, missing):
            sf.write(str(root / f"{meta.name}.wav"), pcm, SAMPLE_RATE, subtype="PCM_16")
            files.append(asdict(meta))
    files.sort(key=lambda f: SUBSETS.index(f["subset"]))  # stable: a subset's files keep their order
    (root / "corpus.json.tmp").write_text(json.dumps(files, indent=1, ensure_ascii=False))
    (root / "corpus.json.tmp").rename(index)
    key_file.write_text(key + "\n")  # last: a build cut short leaves a key that does not vouch for it
    return root


def load_corpus(root: Path, subsets: Iterable[str] = SUBSETS) -> list[CorpusFile]:
    """The files of ``subsets`` in ``root``'s ``corpus.json``, in order."""
    wanted = set(subsets)
    items = json.loads((Path(root) / "corpus.json").read_text())
    return [CorpusFile(**item) for item in items if item["subset"] in wanted]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="build the quality bench's corpus (espeak-ng + sox)")
    parser.add_argument("root", nargs="?", default=None, help="folder (default: the cache's keyed folder)")
    parser.add_argument("--subsets", default=",".join(SUBSETS), help="comma-separated subsets to build")
    parser.add_argument("--seed", type=int, default=SEED)
    a = parser.parse_args()
    print(build_corpus(a.root, a.seed, [s.strip() for s in a.subsets.split(",") if s.strip()]))
