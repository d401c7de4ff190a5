"""``encdec up --decoder-args / --encoder-args``: extra service flags reach the services it starts (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from shared.proto import decoder_pb2, decoder_pb2_grpc

CLIP = Path(__file__).parent / "data" / "meeting.wav"


def test_up_passes_extra_flags_to_the_services(redis_url, tmp_path):
    cmd = [sys.executable, "-m", "shared.cli", "--log-level", "WARNING", "up", "--redis-url", redis_url, "--encoder-port", "0",
           "--decoder-port", "0", "--decoder-args", "--stream-interval 4 --max-num-seqs 2", "--encoder-args=--max-batch-wait-ms 50"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=Path(__file__).parents[1])
    try:
        address = None
        for line in proc.stdout:  # "ready: decoder (public API) at HOST:PORT, ..."
            if line.startswith("ready:"):
                address = line.split(" at ")[1].split(",")[0]
                break
        assert address, "encdec up did not become ready"
        with grpc.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request = decoder_pb2.GenerateRequest(audio=CLIP.read_bytes(), sampling=decoder_pb2.SamplingParams(max_tokens=10))
            messages = list(stub.Generate(request, timeout=120))
        sizes = [len(m.token_ids) for m in messages]
        assert sizes[:3] == [1, 4, 4], sizes  # --stream-interval 4 reached the decoder
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
