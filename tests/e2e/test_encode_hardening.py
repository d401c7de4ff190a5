"""The internal Encode RPC against hostile callers (issue 20, failure 6), with the real services.

Redis + encoder + decoder run as separate processes (``encdec.launcher.Services`` with a generated internal
token, as ``encdec up`` starts them). A loopback caller that knows the decoder's shared-memory segment (any local
user sees it in /dev/shm) tries to write into the running request's cross-attention KV: without the token, with a
wrong one, and with the right token but a target signature that does not match what the decoder reserved. Every
attempt is refused before any work and the running request's text equals HF's. A torch_dist target the decoder
did not sign is never dialled; one that a token holder signed but that accepts and stays silent does not hold up
a real request, neither through the decoder nor to another torch_dist pool.
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from test_e2e_whisper import assert_all_blocks_free

from encdec import DATA_DIR
from encdec.launcher import Services
from shared.internal_auth import InternalAuth, generate_token_file, input_digest, read_token_file
from shared.kv_transport import create_pool
from shared.proto import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc

WHISPER = dict(layers=4, heads=6, head_dim=64, encoder_len=1500)
NEEDED = -(-WHISPER["encoder_len"] // 16)  # cross blocks of one Whisper window at block size 16
SILENT_HANDSHAKE_S = 60  # the encoder's kv_dist_handshake_timeout_s here: a silent peer holds its Encode this long


@pytest.fixture(scope="module")
def services(redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("encode-hardening")
    with Services(
        redis_url=redis_url,
        log_dir=str(log_dir),
        internal_token=True,
        extra_decoder_args=["--max-num-seqs", "1"],  # one request's cross blocks fill the pool: the attack hits them
        extra_encoder_args=["--kv-dist-handshake-timeout-s", str(SILENT_HANDSHAKE_S)],
    ) as svc:
        svc.log_path = Path(log_dir)
        yield svc


@pytest.fixture(scope="module")
def stub(services):
    with grpc.insecure_channel(services.decoder_address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


@pytest.fixture(scope="module")
def auth(services) -> InternalAuth:
    return InternalAuth(read_token_file(services.internal_token_file))


def decoder_target(services) -> encoder_pb2.KVTarget:
    """The decoder's shm pool as a local attacker finds it: the name from its log (or /dev/shm), the shape from
    the segment's header."""
    segment = re.search(r"encdec-kv-([0-9a-f]{16})", (services.log_path / "decoder.log").read_text())
    header = Path(f"/dev/shm/{segment[0]}").read_bytes()[:64]
    _, _, *shape = struct.unpack("<8q", header)
    return encoder_pb2.KVTarget(
        transport="shm", segment=segment[0], shape=shape, dtype="float32", instance_id=segment[1]
    )


def encode_request(target, block_ids, request_id="attack", transfer_id=0, mac=b"") -> encoder_pb2.EncodeRequest:
    noise = np.random.default_rng(0).standard_normal(16000 * 5).astype("<f4") * 0.3
    return encoder_pb2.EncodeRequest(
        request_id=request_id,
        pcm=noise.tobytes(),
        block_ids=block_ids,
        target=target,
        transfer_id=transfer_id,
        target_mac=mac,
    )


def signed(auth: InternalAuth, request: encoder_pb2.EncodeRequest, life_s: float = 60.0) -> encoder_pb2.EncodeRequest:
    """``request`` signed as a decoder of the deployment signs it: its target, ids, input digest and an expiry
    ``life_s`` seconds from now."""
    expires_s = time.time() + life_s
    digest = input_digest(request.pcm, request.features, request.input_ids)
    request.expires_s = expires_s
    request.target_mac = auth.sign_target(
        request.request_id, request.transfer_id, request.block_ids, request.target, digest=digest, expires_s=expires_s
    )
    return request


def direct_encode(services, request, metadata=None, timeout=60):
    with grpc.insecure_channel(services.encoder_address) as channel:
        return encoder_pb2_grpc.EncoderServiceStub(channel).Encode(request, metadata=metadata, timeout=timeout)


def generate(stub, name: str, request_id: str = "") -> list[int]:
    request = decoder_pb2.GenerateRequest(request_id=request_id, audio=(DATA_DIR / name).read_bytes())
    return [t for m in stub.Generate(request, timeout=180) for t in m.token_ids]


def wait_decoding(stub, request_id: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id)).state
            if state == decoder_pb2.REQUEST_STATE_DECODING:
                return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        time.sleep(0.02)
    raise AssertionError(f"{request_id} never reached DECODING")


def all_block_ranges(target) -> list[list[int]]:
    """Block-id lists of one window each that together cover every block of the pool."""
    num_blocks = target.shape[2]
    return [
        list(range(start, start + NEEDED))
        for start in sorted({min(s, num_blocks - NEEDED) for s in range(0, num_blocks, NEEDED)})
    ]


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_unauthenticated_or_forged_encode_writes_nothing_into_a_running_request(
    services, stub, auth, hf_whisper_tokens
):
    """The break test's attack: a loopback caller names the decoder's segment and overwrites every cross block
    while a request decodes. Without the token, with a wrong one, and with the token but a signature made for
    other blocks / another request, each Encode is refused and the request's text stays HF's."""
    target = decoder_target(services)
    request_id = f"victim-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        victim = pool.submit(generate, stub, "meeting.wav", request_id)
        wait_decoding(stub, request_id)
        wrong = (("authorization", "Bearer " + "x" * 43),)
        outcomes = []
        for block_ids in all_block_ranges(target):
            request = encode_request(target, block_ids)
            outcomes.append(refused(lambda r=request: direct_encode(services, r)))  # no token
            outcomes.append(refused(lambda r=request: direct_encode(services, r, wrong)))
            forged_blocks = auth.sign_target("attack", 0, block_ids[::-1], target)  # signed for other blocks
            outcomes.append(
                refused(
                    lambda b=block_ids, m=forged_blocks: direct_encode(
                        services, encode_request(target, b, mac=m), auth.metadata
                    )
                )
            )
            other_request = auth.sign_target(request_id, 0, block_ids, target)  # signed for the victim's id
            outcomes.append(
                refused(
                    lambda b=block_ids, m=other_request: direct_encode(
                        services, encode_request(target, b, mac=m), auth.metadata
                    )
                )
            )
        tokens = victim.result(timeout=180)
    codes = [o.code() for o in outcomes]
    assert codes == [
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.PERMISSION_DENIED,
    ] * len(all_block_ranges(target)), [(o.code(), o.details()) for o in outcomes]
    assert "--internal-token-file" in outcomes[0].details() and "--internal-token-file" in outcomes[1].details()
    assert tokens[:-1] == hf_whisper_tokens["meeting.wav"] and tokens[-1] == 50256
    assert_all_blocks_free(stub)
    token = read_token_file(services.internal_token_file).decode()
    for log in services.log_path.glob("*.log"):  # the secret is never logged
        assert token not in log.read_text(errors="replace"), log


def _hwm_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM:"))


def test_an_encode_without_the_token_is_refused_before_its_body_is_read(services):
    """Issue 34 break test: the encoder checked the internal token in Encode's handler, after gRPC had received and
    parsed the message: 8 unauthenticated 50 MB Encodes took it from 555 MB to 1.2 GB, held. The token is now
    checked at the call's headers; the encoder's peak memory stays where it was."""
    pid = services.process("encoder").pid
    before = _hwm_mib(pid)
    body = encoder_pb2.EncodeRequest(request_id="flood", pcm=bytes(40 << 20))
    options = [("grpc.max_send_message_length", 1 << 30)]
    with grpc.insecure_channel(services.encoder_address, options=options) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        calls = [stub.Encode.future(body, timeout=60) for _ in range(8)]
        codes = [refused(call.result).code() for call in calls]
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    # gRPC may take in what flow control lets through before the refusal (a few MiB a call): far from the bodies
    # themselves (320 MB; the old check in the handler peaked ~460 MiB above). CI saw +41 MiB.
    assert _hwm_mib(pid) - before < 160, (before, _hwm_mib(pid))


def test_unsigned_torch_dist_target_is_never_dialled(services, auth):
    """An Encode naming a torch_dist address the decoder did not sign is refused before the encoder connects."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(1.0)
        target = encoder_pb2.KVTarget(
            transport="torch_dist",
            segment=f"127.0.0.1:{listener.getsockname()[1]}",
            shape=[4, 2, NEEDED, 16, 6, 64],
            dtype="float32",
            instance_id="0123456789abcdef",
        )
        for mac in (b"", b"\0" * 32, auth.sign_target("attack", 1, list(range(NEEDED)), target)[:-1] + b"\0"):
            error = refused(
                lambda m=mac: direct_encode(
                    services, encode_request(target, list(range(NEEDED)), transfer_id=1, mac=m), auth.metadata
                )
            )
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
            assert "signature" in error.details()
        with pytest.raises(TimeoutError):  # nobody dialled the address
            listener.accept()


def test_silent_torch_dist_peer_does_not_block_other_encodes(services, stub, auth, hf_whisper_tokens):
    """A signed torch_dist target that accepts TCP and never speaks holds only its own Encode: while it waits
    (the encoder's handshake bound is SILENT_HANDSHAKE_S here), a Generate through the decoder and an Encode into
    another torch_dist pool both complete."""
    accepted: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as silent:
        stop = threading.Event()

        def accept() -> None:
            silent.settimeout(0.2)
            while not stop.is_set():
                try:
                    accepted.append(silent.accept()[0])
                except TimeoutError:
                    pass

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        target = encoder_pb2.KVTarget(
            transport="torch_dist",
            segment=f"127.0.0.1:{silent.getsockname()[1]}",
            shape=[4, 2, NEEDED, 16, 6, 64],
            dtype="float32",
            instance_id="0123456789abcdef",
        )
        block_ids = list(range(NEEDED))
        channel = grpc.insecure_channel(services.encoder_address)
        try:
            pending = encoder_pb2_grpc.EncoderServiceStub(channel).Encode.future(
                signed(auth, encode_request(target, block_ids, "silent", 5), SILENT_HANDSHAKE_S + 30),
                metadata=auth.metadata,
                timeout=SILENT_HANDSHAKE_S + 30,
            )
            deadline = time.monotonic() + 30
            while not accepted and time.monotonic() < deadline:  # the encoder is now stuck in its handshake
                time.sleep(0.05)
            assert accepted, "the encoder never dialled the signed target"

            tokens = generate(stub, "short.wav")  # through the decoder (shm)
            assert tokens[:-1] == hf_whisper_tokens["short.wav"]

            shape = (WHISPER["layers"], 2, NEEDED + 1, 16, WHISPER["heads"], WHISPER["head_dim"])
            # a second, real torch_dist decoder of this deployment (its pairing signed with the internal token)
            other = create_pool("torch_dist", shape, address="127.0.0.1:0", pair_key=auth.pair_key)
            try:
                other.tensor.fill_(-3.0)
                spec = other.spec
                real = encoder_pb2.KVTarget(
                    transport=spec.transport,
                    segment=spec.segment,
                    shape=spec.shape,
                    dtype=spec.dtype,
                    instance_id=spec.instance_id,
                )
                arrival = other.expect(7, block_ids)
                response = direct_encode(
                    services,
                    signed(auth, encode_request(real, block_ids, "real", 7)),
                    auth.metadata,
                )
                assert response.encoder_len == WHISPER["encoder_len"]
                assert arrival.result(timeout=30).nbytes == response.transfer_bytes
                written = other.tensor[:, :, block_ids].reshape(shape[0], 2, -1, shape[4], shape[5])
                assert torch.all(written[:, :, : WHISPER["encoder_len"]] != -3.0)
            finally:
                other.close()
            assert not pending.done(), "the silent target's Encode should still be waiting for its handshake"
            pending.cancel()
        finally:
            channel.close()
            stop.set()
            acceptor.join(5)
            for conn in accepted:
                conn.close()
    assert_all_blocks_free(stub)


def test_a_captured_encode_is_taken_once_for_its_input_until_it_expires(services, stub, auth):
    """Issue 34 item 3: an Encode a decoder signed, captured off the plaintext internal port, cannot be sent again
    (it once wrote its audio's KV into blocks another request then read: 6 of 8 tries), nor with other audio, nor
    after its expiry; the first one writes, and the port serves on."""
    target = decoder_target(services)
    block_ids = all_block_ranges(target)[-1]
    captured = signed(auth, encode_request(target, block_ids, "captured", 11))
    assert direct_encode(services, captured, auth.metadata).encoder_len == WHISPER["encoder_len"]
    replay = refused(lambda: direct_encode(services, captured, auth.metadata))
    assert replay.code() == grpc.StatusCode.PERMISSION_DENIED and "replay" in replay.details(), replay.details()

    other_audio = encoder_pb2.EncodeRequest()
    other_audio.CopyFrom(signed(auth, encode_request(target, block_ids, "captured", 12)))
    other_audio.pcm = np.zeros(16000 * 5, dtype="<f4").tobytes()
    error = refused(lambda: direct_encode(services, other_audio, auth.metadata))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "signature" in error.details(), error.details()

    expired = signed(auth, encode_request(target, block_ids, "captured", 13), life_s=-120.0)
    error = refused(lambda: direct_encode(services, expired, auth.metadata))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "expired" in error.details(), error.details()
    assert generate(stub, "short.wav")  # the decoder's own Encodes, signed anew each time, still pass
    assert_all_blocks_free(stub)


@pytest.mark.parametrize("decoder_has_token", [True, False])
def test_mismatched_token_files_fail_generate_with_a_message_to_act_on(redis_url, tmp_path, decoder_has_token):
    """Decoder and encoder started with different token files (or the decoder with none): Generate ends with
    UNAVAILABLE saying to start both with the same --internal-token-file, nothing leaks, and the record is FAILED."""
    encoder_file = generate_token_file(str(tmp_path / "encoder-token"))
    decoder_args = ["--internal-token-file", generate_token_file(str(tmp_path / "decoder-token"))]
    with Services(
        redis_url=redis_url,
        log_dir=str(tmp_path / "logs"),
        extra_encoder_args=["--internal-token-file", encoder_file],
        extra_decoder_args=decoder_args if decoder_has_token else [],
    ) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request_id = f"mismatch-{uuid.uuid4().hex[:6]}"
            error = refused(lambda: generate(stub, "short.wav", request_id))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            assert "UNAUTHENTICATED" in error.details() and "--internal-token-file" in error.details()
            record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
            assert record.state == decoder_pb2.REQUEST_STATE_FAILED, record
            assert_all_blocks_free(stub)


def test_encode_travels_over_tls_when_the_encoder_has_a_certificate(redis_url, tmp_path):
    """Issue 34 item 3 (placements across hosts): an encoder started with --tls-cert / --tls-key serves Encode over
    TLS only (a plaintext caller gets nothing), and a decoder given --encoder-tls-ca transcribes through it."""
    from helpers.cli import encdec
    from helpers.tls_certs import have_openssl, make_pki

    from encdec.launcher import stop_processes, wait_healthy
    from encdec.redis_server import free_ports
    from shared.tls import ClientSecurity

    if not have_openssl():
        pytest.skip("needs the openssl command")
    pki = make_pki(tmp_path / "pki")
    token = generate_token_file(str(tmp_path / "internal-token"))
    encoder_port, decoder_port, m1, m2 = free_ports(4)
    common = ["--internal-token-file", token]
    procs = []
    try:
        with open(tmp_path / "encoder.log", "ab") as log:
            procs.append(
                subprocess.Popen(
                    encdec(
                        "serve-encoder",
                        "--port",
                        str(encoder_port),
                        "--metrics-port",
                        str(m1),
                        *common,
                        "--tls-cert",
                        pki.server_cert,
                        "--tls-key",
                        pki.server_key,
                    ),  # fmt: skip
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        encoder = f"127.0.0.1:{encoder_port}"
        wait_healthy(encoder, 120, procs[0], ClientSecurity(tls_ca=pki.ca).credentials())
        with grpc.insecure_channel(encoder) as channel:  # a plaintext caller (a sniffed Encode replayed) gets nothing
            with pytest.raises(grpc.RpcError) as err:
                encoder_pb2_grpc.EncoderServiceStub(channel).Encode(encoder_pb2.EncodeRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        with open(tmp_path / "decoder.log", "ab") as log:
            procs.append(
                subprocess.Popen(
                    encdec(
                        "serve-decoder",
                        "--port",
                        str(decoder_port),
                        "--metrics-port",
                        str(m2),
                        *common,
                        "--encoder-address",
                        encoder,
                        "--redis-url",
                        redis_url,
                        "--encoder-tls-ca",
                        pki.ca,
                    ),  # fmt: skip
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        wait_healthy(f"127.0.0.1:{decoder_port}", 120, procs[1])
        with grpc.insecure_channel(f"127.0.0.1:{decoder_port}") as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request = decoder_pb2.GenerateRequest(audio=(DATA_DIR / "sample.wav").read_bytes())
            text = "".join(m.text for m in stub.Generate(request, timeout=120))
        assert "quarterly budget" in text, text
    finally:
        stop_processes(procs)
