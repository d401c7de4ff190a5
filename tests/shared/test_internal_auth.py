"""The internal token and the KV-target signature (``shared.internal_auth``), the config field and the launcher's
generated token file."""

from __future__ import annotations

import os
import stat

import pytest

from encdec.launcher import Services
from shared.config import DecoderServiceConfig, EncoderServiceConfig
from shared.errors import PermissionDeniedError, UnauthenticatedError
from shared.internal_auth import (
    CLOCK_SKEW_S,
    MAX_SIGNED_LIFETIME_S,
    InternalAuth,
    ensure_token_file,
    generate_token_file,
    input_digest,
    read_token_file,
)
from shared.kv_transport import KVTargetSpec

TARGET = KVTargetSpec("shm", "encdec-kv-0123456789abcdef", (4, 2, 100, 16, 6, 64), "float32", "0123456789abcdef")
OTHER_TARGETS = [
    KVTargetSpec("torch_dist", TARGET.segment, TARGET.shape, TARGET.dtype, TARGET.instance_id),
    KVTargetSpec("shm", "encdec-kv-fedcba9876543210", TARGET.shape, TARGET.dtype, TARGET.instance_id),
    KVTargetSpec("shm", TARGET.segment, (4, 2, 101, 16, 6, 64), TARGET.dtype, TARGET.instance_id),
    KVTargetSpec("shm", TARGET.segment, TARGET.shape, "float16", TARGET.instance_id),
    KVTargetSpec("shm", TARGET.segment, TARGET.shape, TARGET.dtype, "fedcba9876543210"),
]


@pytest.fixture
def token_file(tmp_path):
    return generate_token_file(str(tmp_path / "token"))


def test_generated_token_file_is_private_and_readable(token_file):
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    token = read_token_file(token_file)
    assert len(token) >= 40 and token != read_token_file(generate_token_file(token_file + "2"))


def test_a_short_or_missing_token_file_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_token_file(str(short))
    with pytest.raises(ValueError, match="cannot be read"):
        read_token_file(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot be created"):
        ensure_token_file(str(tmp_path / "no-dir" / "token"))
    with pytest.raises(ValueError, match="kv_dist_handshake_timeout_s"):
        EncoderServiceConfig(kv_dist_handshake_timeout_s=0)


def test_the_encoder_creates_a_missing_token_file_once(tmp_path):
    path = str(tmp_path / "token")
    first = ensure_token_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and ensure_token_file(path) == first
    assert InternalAuth.from_file(path, "encoder", create=True).enabled
    assert sorted(os.listdir(tmp_path)) == ["token"]  # no scratch file left
    with pytest.raises(ValueError, match="cannot be read"):  # the decoder does not create it
        InternalAuth.from_file(str(tmp_path / "other"), "decoder")


def test_metadata_check_is_exact(token_file):
    auth = InternalAuth.from_file(token_file, "test")
    auth.check_metadata(auth.metadata)
    auth.check_metadata([("x-other", "1"), *auth.metadata])
    token = read_token_file(token_file).decode()
    for metadata in (None, [], [("authorization", "Bearer " + token[:-1])], [("authorization", token)]):
        with pytest.raises(UnauthenticatedError, match="--internal-token-file"):
            auth.check_metadata(metadata)
    assert token not in repr(auth)
    InternalAuth(None).check_metadata(None)  # no token configured: as before


def test_target_signature_binds_ids_blocks_target_and_model(token_file):
    auth = InternalAuth.from_file(token_file, "test")
    mac = auth.sign_target("req-1", 7, [3, 1, 2], TARGET, "whisper-tiny.en", expires_s=2e9)
    assert len(mac) == 32
    auth.verify_target(mac, "req-1", 7, [3, 1, 2], TARGET, "whisper-tiny.en", expires_s=2e9, now=2e9 - 10)
    changed = [
        ("req-2", 7, [3, 1, 2], TARGET, "whisper-tiny.en"),
        ("req-1", 8, [3, 1, 2], TARGET, "whisper-tiny.en"),
        ("req-1", 7, [1, 2, 3], TARGET, "whisper-tiny.en"),
        ("req-1", 7, [3, 1], TARGET, "whisper-tiny.en"),
        ("req-1", 7, [3, 1, 2], TARGET, "t5-small"),
        *[("req-1", 7, [3, 1, 2], t, "whisper-tiny.en") for t in OTHER_TARGETS],
    ]
    for fields in changed:
        with pytest.raises(PermissionDeniedError, match="signature"):
            auth.verify_target(mac, *fields)
    with pytest.raises(PermissionDeniedError):
        auth.verify_target(b"", "req-1", 7, [3, 1, 2], TARGET, "whisper-tiny.en")
    other = InternalAuth(b"another-token-of-this-deployment")
    with pytest.raises(PermissionDeniedError):
        other.verify_target(mac, "req-1", 7, [3, 1, 2], TARGET, "whisper-tiny.en")
    assert InternalAuth(None).sign_target("req-1", 7, [3], TARGET) == b""


def test_signature_binds_the_input_and_its_expiry_and_is_taken_once(token_file):
    """Issue 34 item 3: the MAC covers the input's digest and the expiry; the encoder takes each one once, refuses
    it expired (past the clock skew) or claiming a life past MAX_SIGNED_LIFETIME_S, and forgets it once expired."""
    decoder, encoder = InternalAuth.from_file(token_file, "decoder"), InternalAuth.from_file(token_file, "encoder")
    digest = input_digest(features=b"\x01" * 64)
    assert digest != input_digest(pcm=b"\x01" * 64)  # the field is part of it
    assert input_digest(input_ids=[1, 23]) != input_digest(input_ids=[12, 3])
    now = 1_000_000.0
    args = ("req-1", 7, [3, 1, 2], TARGET, "whisper-tiny.en")
    mac = decoder.sign_target(*args, digest=digest, expires_s=now + 60)
    for other in ({"digest": input_digest(features=b"\x02" * 64), "expires_s": now + 60}, {"digest": digest}):
        with pytest.raises(PermissionDeniedError, match="signature"):
            encoder.verify_target(mac, *args, **other, now=now)
    encoder.verify_target(mac, *args, digest=digest, expires_s=now + 60, now=now)
    with pytest.raises(PermissionDeniedError, match="replay"):
        encoder.verify_target(mac, *args, digest=digest, expires_s=now + 60, now=now + 1)
    late = now + 60 + CLOCK_SKEW_S + 1
    with pytest.raises(PermissionDeniedError, match="expired"):
        encoder.verify_target(mac, *args, digest=digest, expires_s=now + 60, now=late)
    encoder.verify_target(  # a fresh one taken later: the expired one is forgotten
        decoder.sign_target(*args, digest=digest, expires_s=late + 5),
        *args,
        digest=digest,
        expires_s=late + 5,
        now=late,
    )
    assert len(encoder.replays) == 1
    far = now + MAX_SIGNED_LIFETIME_S + CLOCK_SKEW_S + 10
    with pytest.raises(PermissionDeniedError, match="past"):
        encoder.verify_target(
            decoder.sign_target(*args, digest=digest, expires_s=far), *args, digest=digest, expires_s=far, now=now
        )


def test_decoder_config_takes_the_same_flag(token_file):
    assert DecoderServiceConfig(internal_token_file=token_file).internal_token_file == token_file


def test_launcher_generates_one_token_for_both_services_and_removes_it():
    services = Services(internal_token=True)
    args = services._token_args()
    path = services.internal_token_file
    assert args == ["--internal-token-file", path] and services._token_args() == args
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    services.stop()
    assert not os.path.exists(path) and services.internal_token_file is None
    assert Services()._token_args() == []
    assert Services(internal_token=True, extra_encoder_args=["--internal-token-file", "x"])._token_args() == []
