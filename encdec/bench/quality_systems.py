"""The systems of ``encdec bench quality``, each transcribing the corpus files on the same weights (float32).

Every runner returns ``{"wall_s", "files": {name: {"text", "language", "segments"[, "error"]}}}`` (segments:
``{"start", "end", "text"[, "words"]}``, seconds) and, where measured, ``"alone"``: the corpus's longest file
transcribed by itself, ``{"segment": {"wall_s", "result"}, "word": {...}}`` with segment and with word
timestamps. Anchors run each in a fresh process (CTranslate2 and torch in separate processes: see
``faster_whisper_anchor``); their model load and a 5 s warm-up are outside the timings.

* ``ours``: our two services (started here unless an address is given, ``--num-threads`` each, the decoder's
  encoder-output cache off) over gRPC with ``WhisperOptions(timestamps=SEGMENT)`` and every other option at
  its default: no language (a multilingual checkpoint detects it, an English-only one is English), the
  decoder's default decoding rules, the path a user's request takes. One untimed warm-up (the corpus's
  shortest file), the longest file alone (SEGMENT, then WORD), then every file at once. A file the
  decoder's admission control refuses (RESOURCE_EXHAUSTED: its queue's estimated wait is over
  ``--max-queue-time-s``, 30 s) is sent again after a backoff, as its message asks a client to; its
  ``"retries"`` are counted, and the all-files wall time includes those waits.
* ``fw-sequential``: faster-whisper ``WhisperModel.transcribe(beam_size=1)`` with its other defaults
  (temperature fallback, best_of 5, conditioned on the previous text, no VAD), file after file, plus the
  longest file alone with segment and with ``word_timestamps=True``.
* ``fw-batched``: ``BatchedInferencePipeline.transcribe(batch_size=16, beam_size=1)`` file after file. Its
  segments are silero-vad chunks of up to 30 s of speech, whose times span the silence the VAD dropped
  between: its words in gaps, counted by segment times, are an upper bound.
* ``hf``: HF transformers long-form ``generate`` (``whisper_longform.hf_long_form``: temperature fallback,
  thresholds 2.4 / -1.0 / 0.6, conditioned on the previous tokens, timestamps, ``return_segments=True``; a
  multilingual checkpoint detects the language), file after file.
"""

from __future__ import annotations

import asyncio
import time

SYSTEMS = ("ours", "fw-sequential", "fw-batched", "hf")
RETRY_BACKOFF_S = (1.0, 8.0)  # ours: first and longest wait before a refused file is sent again (doubling)
MAX_RETRIES = 100
CT2_SYSTEMS = ("fw-sequential", "fw-batched")  # left out by --skip-ct2
FW_BATCH_SIZE = 16  # BatchedInferencePipeline chunks per batch (its README's example)
NAMES = {
    "ours": "encdec-serve fp32 (2 services, gRPC)",
    "fw-sequential": "faster-whisper fp32 WhisperModel",
    "fw-batched": f"faster-whisper fp32 BatchedInferencePipeline batch {FW_BATCH_SIZE}",
    "hf": "HF transformers fp32 generate",
}


def _failed(exc: Exception) -> dict:
    import grpc

    error = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
    return {"text": "", "language": "", "segments": [], "error": error}


async def _ours_runs(address: str, files: dict[str, str], alone: str, warmup: str, extra: str | None) -> dict:
    import grpc
    from google.protobuf import json_format

    from encdec.bench.whisper import transcribe_over_grpc
    from shared.proto import decoder_pb2, decoder_pb2_grpc

    base = json_format.Parse(extra or "{}", decoder_pb2.WhisperOptions())
    segment, word = decoder_pb2.WhisperOptions(), decoder_pb2.WhisperOptions()
    for options, timestamps in ((segment, "SEGMENT"), (word, "WORD")):
        options.CopyFrom(base)
        options.timestamps = decoder_pb2.TimestampGranularity.Value(f"TIMESTAMP_GRANULARITY_{timestamps}")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)

        async def one(path: str, options) -> dict:
            wait, retries = RETRY_BACKOFF_S[0], 0
            while True:
                try:
                    return {**await transcribe_over_grpc(stub, path, options), "retries": retries}
                except grpc.aio.AioRpcError as exc:  # a failed file is reported, the others still count
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or retries == MAX_RETRIES:
                        return {**_failed(exc), "retries": retries}
                await asyncio.sleep(wait)
                wait, retries = min(2 * wait, RETRY_BACKOFF_S[1]), retries + 1

        await transcribe_over_grpc(stub, warmup, segment)
        out: dict = {"alone": {}}
        for key, options in (("segment", segment), ("word", word)):
            start = time.perf_counter()
            result = await transcribe_over_grpc(stub, alone, options)
            out["alone"][key] = {"wall_s": time.perf_counter() - start, "result": result}
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, segment) for p in files.values()))
        out["wall_s"] = time.perf_counter() - start
    out["files"] = dict(zip(files, results))
    return out


def run_ours(
    model: str,
    files: dict[str, str],
    alone: str,
    warmup: str,
    threads: int,
    address: str | None,
    extra_options: str | None = None,
) -> dict:
    """Our services on ``files`` (name -> WAV path), see the module docstring; with services started here also
    ``"cpu_s"``: the encoder's and the decoder's CPU seconds over the all-at-once run and the alone runs.
    ``extra_options``: more ``WhisperOptions`` fields as JSON (``--ours-options``), on every request.

    Raises:
        grpc.aio.AioRpcError: the warm-up or an alone run failed. RuntimeError: the services did not start.
    """
    from encdec.bench.whisper import on_services

    out, cpu = on_services(
        model, threads, address, lambda at: asyncio.run(_ours_runs(at, files, alone, warmup, extra_options))
    )
    return out if cpu is None else {**out, "cpu_s": cpu}


def _by_name(names, per_file: list[dict]) -> dict[str, dict]:
    return {n: {"language": "", **f} for n, f in zip(names, per_file)}


def run_faster_whisper(system: str, model_dir: str, files: dict[str, str], threads: int, alone: str | None) -> dict:
    """``fw-sequential`` or ``fw-batched`` on ``files`` file after file (``faster_whisper_anchor``, one process);
    with ``alone`` also that file by itself with segment and with word timestamps (a process each).

    Raises:
        subprocess.CalledProcessError: an anchor process failed.
    """
    from encdec.bench.faster_whisper_anchor import run_anchor

    def anchor(options: str, paths: list[str]) -> dict:
        return run_anchor(system, model_dir, "float32", threads, options, FW_BATCH_SIZE, paths)

    main = anchor("detect,segments", list(files.values()))
    out = {"wall_s": main["wall_s"], "files": _by_name(files, main["files"])}
    if alone:
        out["alone"] = {}
        for key, options in (("segment", "detect,segments"), ("word", "detect,words")):
            r = anchor(options, [alone])
            out["alone"][key] = {"wall_s": r["wall_s"], "result": r["files"][0]}
    return out


def run_hf(model_dir: str, files: dict[str, str], threads: int) -> dict:
    """HF long-form ``generate`` on ``files`` file after file, in one process (``whisper_longform``).

    Raises:
        subprocess.CalledProcessError: the process failed.
    """
    from encdec.bench.whisper_longform import _run_hf

    r = _run_hf(model_dir, threads, "sequential,detect,segments", list(files.values()))
    return {"wall_s": r["wall_s"], "files": _by_name(files, r["files"])}
