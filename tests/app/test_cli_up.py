"""``encdec up --decoder-args / --encoder-args``: extra service flags reach the services it starts (real processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
from helpers.cli import encdec

from encdec import DATA_DIR
from shared.proto import decoder_pb2, decoder_pb2_grpc

CLIP = DATA_DIR / "meeting.wav"


def _up(*args: str, **popen) -> subprocess.Popen:
    """``encdec up`` on auto-picked ports with ``args`` added, in its own process group, stdout piped."""
    cmd = encdec(
        "up",
        "--encoder-port",
        "0",
        "--decoder-port",
        "0",
        "--http-port",
        "0",
        *args,
    )
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=Path(__file__).parents[2], **popen
    )


def _ready_address(proc: subprocess.Popen) -> str | None:
    """The decoder address of ``encdec up``'s "ready: decoder (gRPC) at HOST:PORT, ..." line, or None."""
    for line in proc.stdout:
        if line.startswith("ready:"):
            return line.split(" at ")[1].split(",")[0]
    return None


def test_up_passes_extra_flags_to_the_services(redis_url, tmp_path):
    proc = _up(
        "--redis-url",
        redis_url,
        "--decoder-args",
        "--stream-interval 4 --max-num-seqs 2",
        "--encoder-args=--max-batch-wait-ms 50",
    )
    try:
        address = _ready_address(proc)
        assert address, "encdec up did not become ready"
        with grpc.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request = decoder_pb2.GenerateRequest(
                audio=CLIP.read_bytes(),
                sampling=decoder_pb2.SamplingParams(max_tokens=10),
                whisper=decoder_pb2.WhisperOptions(decoding_rules="hf"),  # token-streamed (openai: window by window)
            )
            messages = list(stub.Generate(request, timeout=120))
        sizes = [len(m.token_ids) for m in messages]
        assert sizes[:3] == [1, 4, 4], sizes  # --stream-interval 4 reached the decoder
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)


def _pid_of(*argv_parts: str) -> int:
    """The pid of the process whose command line holds ``argv_parts`` in order."""
    wanted = "\0".join(argv_parts)
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if wanted in cmdline.read_text():
                return int(cmdline.parent.name)
        except OSError:  # exited meanwhile
            continue
    raise LookupError(argv_parts)


def test_up_exits_nonzero_when_a_service_dies(redis_url):
    proc = _up(
        "--redis-url",
        redis_url,
        "--decoder-args=--metrics-port 0",
        "--encoder-args=--metrics-port 0",
        stderr=subprocess.PIPE,
    )
    try:
        port = _ready_address(proc).rsplit(":", 1)[1]
        os.kill(_pid_of("serve-decoder", "--port", port), signal.SIGKILL)  # a crash
        assert proc.wait(timeout=60) == 1
        assert "encdec: error: decoder (exit code -9) stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_lets_the_decoder_drain_into_its_local_redis(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group of ``encdec up``: the local redis-server must
    outlive the decoder's drain (its own session, stopped last), so the request that was running is still
    recorded; before, Redis died at once and the decoder logged 'could not record FINISHED'."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # `up` starts its own redis-server
    proc = _up("--decoder-args=--metrics-port 0", "--encoder-args=--metrics-port 0", stderr=subprocess.PIPE, env=env)
    try:
        address = _ready_address(proc)
        assert address, "encdec up did not become ready"
        with grpc.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            sampling = decoder_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
            stream = stub.Generate(decoder_pb2.GenerateRequest(audio=CLIP.read_bytes(), sampling=sampling), timeout=120)
            first = next(stream)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
            rest = list(stream)
        tokens = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
        assert rest[-1].finish_reason == decoder_pb2.FINISH_REASON_LENGTH and tokens == 200  # drained, not cut
        assert proc.wait(timeout=60) == 0
        stderr = proc.stderr.read()
        assert "could not record" not in stderr and "ConnectionError" not in stderr, stderr[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _cmdline_of(service: str, port: str) -> list[str]:
    """The argv of the ``serve-encoder`` / ``serve-decoder`` process listening on ``port``."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_text().split("\0")
        except OSError:  # exited meanwhile
            continue
        if service in argv and "--port" in argv and argv[argv.index("--port") + 1] == port:
            return argv
    raise LookupError(service, port)


def test_up_dtype_reaches_both_services_and_a_service_flag_wins(redis_url):
    from shared.device import cpu_bf16_flags

    if not cpu_bf16_flags():
        pytest.skip("this CPU has neither avx512_bf16 nor amx_bf16: --dtype bfloat16 is refused here")
    proc = _up("--redis-url", redis_url, "--no-http", "--dtype", "bfloat16", "--decoder-args=--dtype float32")
    try:
        address = _ready_address(proc)
        assert address, "encdec up did not become ready"
        port = address.rsplit(":", 1)[1]
        decoder = _cmdline_of("serve-decoder", port)
        encoder_port = decoder[decoder.index("--encoder-address") + 1].rsplit(":", 1)[1]
        encoder = _cmdline_of("serve-encoder", encoder_port)
        last_dtype = lambda argv: argv[len(argv) - 1 - argv[::-1].index("--dtype") + 1]
        assert last_dtype(encoder) == "bfloat16" and last_dtype(decoder) == "float32"
        with grpc.insecure_channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            text = "".join(
                m.text for m in stub.Generate(decoder_pb2.GenerateRequest(audio=CLIP.read_bytes()), timeout=120)
            )
        assert len(text.split()) >= 4, text  # a bfloat16 encoder behind a float32 decoder transcribes
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)


def test_up_bound_beyond_loopback_serves_nothing_without_its_generated_secrets(redis_url):
    """Issue 34 item 1: ``encdec up --host 0.0.0.0`` (``ENCDEC_HOST`` is its default) generates a bearer token for
    the gRPC port (the gateway sends it) and an API key for the HTTP port, says where they are, and refuses calls
    without them; the encoder (internal) stays on loopback (a new user found it on 0.0.0.0)."""
    import httpx

    proc = _up("--redis-url", redis_url, "--host", "0.0.0.0", stderr=subprocess.DEVNULL)
    try:
        ready = next((line for line in proc.stdout if line.startswith("ready:")), "")
        assert ready, "encdec up did not become ready"
        address = ready.split(" at ")[1].split(",")[0]
        url = ready.split("HTTP API at ")[1].split("/v1")[0]
        with grpc.insecure_channel(address) as channel:  # before reading on: nothing more is printed on old code
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStats(decoder_pb2.GetStatsRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            token_line, key_line = next(proc.stdout), next(proc.stdout)
            token_file = token_line.split("--token-file ")[1].rstrip(")\n")
            key_file = key_line.split("the key in ")[1].split(">")[0]
            token, key = Path(token_file).read_text().strip(), Path(key_file).read_text().strip()
            assert oct(Path(token_file).stat().st_mode & 0o777) == "0o600"
            stats = stub.GetStats(decoder_pb2.GetStatsRequest(), metadata=[("authorization", f"Bearer {token}")])
            assert stats.model
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert models.status_code == 200, models.text  # the gateway reached the decoder with the token
        # /metrics (plain HTTP, no token) stays on loopback: the decoder's 9400 answers there and not on the
        # machine's own address, where its gRPC port does answer (the break test found 9400-9402 on 0.0.0.0)
        decoder = _cmdline_of("serve-decoder", address.rsplit(":", 1)[1])
        assert decoder[decoder.index("--metrics-host") + 1] == "127.0.0.1", decoder
        encoder_port = int(decoder[decoder.index("--encoder-address") + 1].rsplit(":", 1)[1])
        encoder = _cmdline_of("serve-encoder", str(encoder_port))
        assert encoder[len(encoder) - 1 - encoder[::-1].index("--host") + 1] == "127.0.0.1", encoder
        assert httpx.get("http://127.0.0.1:9400/metrics", timeout=30).status_code == 200
        own = _own_address()
        if own is not None:
            with socket.create_connection((own, int(address.rsplit(":", 1)[1])), timeout=5):
                pass
            with pytest.raises(OSError):
                socket.create_connection((own, 9400), timeout=5).close()
            with pytest.raises(OSError):  # Encode is internal: not on the machine's address
                socket.create_connection((own, encoder_port), timeout=5).close()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    assert not Path(token_file).exists() and not Path(key_file).exists()  # gone with the services


def _own_address() -> str | None:
    """This machine's non-loopback IPv4 address (the route a packet out would take; nothing is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            own = probe.getsockname()[0]
        except OSError:
            return None
    return None if own.startswith("127.") else own
