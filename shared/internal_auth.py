"""The internal token decoder and encoder of one deployment share, and the KV-target signature made with it.

Encode is an internal RPC: whoever may call it can have the encoder write into a decoder's cross-KV pool or
dial a torch_dist address. With ``--internal-token-file PATH`` on both services (``encdec up`` and compose
generate the file) the decoder sends the token as gRPC metadata (``authorization: Bearer <token>``) and signs
what it reserved: HMAC-SHA256 (RFC 2104, ``hmac``) of the request id, transfer id, block ids and KV target, a
SHA-256 digest of the encoder input (``input_digest``) and an expiry time, under a key derived from the token. The
encoder compares the token in constant time (``hmac.compare_digest``) before any work (UNAUTHENTICATED otherwise)
and verifies the signature before it writes or dials anything (PERMISSION_DENIED): a segment name seen in
``/dev/shm``, or a ``host:port`` the caller picked, is then no capability. A captured Encode cannot be replayed
(issue 34 item 3: a replay timed into another request's batch wrote its own audio's KV into blocks that request
then read): other audio breaks the digest, a signature is taken once (``ReplayGuard``) and only until its expiry
(the call's own deadline), so blocks freed and handed to another request are never written by an old Encode.
The token itself is never logged.

Without a token file both services behave as before and log one warning at start-up.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Sequence

import grpc

from shared.errors import PermissionDeniedError, UnauthenticatedError

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
SCHEME = "Bearer "
MIN_TOKEN_CHARS = 16
_TARGET_KEY_LABEL = b"encdec-serve kv-target v1"  # the signing key is HMAC(token, label): one secret, three uses
_PAIR_KEY_LABEL = b"encdec-serve kv-pair v1"  # torch_dist pairing (shared.kv_transport.torch_dist)
_SAME_FILE_HINT = "start the decoder and the encoder with the same --internal-token-file"
# Seconds a signed Encode may be dated ahead of or behind the encoder's clock (decoder and encoder on other hosts).
CLOCK_SKEW_S = 30.0
# Longest life a signature may claim (seconds past the encoder's clock): bounds what ReplayGuard remembers.
MAX_SIGNED_LIFETIME_S = 3600.0


def input_digest(pcm: bytes = b"", features: bytes = b"", input_ids: Sequence[int] = ()) -> bytes:
    """SHA-256 (32 bytes) of an Encode's input as it travels: ``pcm`` / ``features`` (float32 little-endian bytes)
    and ``input_ids``, each part labelled and length-prefixed (no two inputs share a digest by moving bytes from
    one field to another)."""
    h = hashlib.sha256()
    ids = ",".join(str(int(t)) for t in input_ids).encode()
    for label, data in ((b"pcm", pcm), (b"features", features), (b"ids", ids)):
        h.update(label + len(data).to_bytes(8, "little") + bytes(data))
    return h.digest()


# An input past this many bytes is hashed on a worker thread (``input_digest_off_loop``): SHA-256 runs ~1 GB/s, so
# a whole clip's PCM (up to --max-message-bytes) would stall the event loop for tens of milliseconds.
OFF_LOOP_DIGEST_BYTES = 1 << 20


async def input_digest_off_loop(pcm: bytes = b"", features: bytes = b"", input_ids: Sequence[int] = ()) -> bytes:
    """``input_digest``, on a worker thread when ``pcm`` and ``features`` hold ``OFF_LOOP_DIGEST_BYTES`` or more
    (a Whisper window's 960 kB of log-mel is hashed in place)."""
    if len(pcm) + len(features) < OFF_LOOP_DIGEST_BYTES:
        return input_digest(pcm, features, input_ids)
    return await asyncio.to_thread(input_digest, pcm, features, input_ids)


class ReplayGuard:
    """The signatures an encoder has taken and when each expires: a second Encode with one of them is a replay.

    A signature is remembered until its expiry (plus ``CLOCK_SKEW_S``); after that its own expiry refuses it, so
    memory stays bounded by the Encodes of one ``MAX_SIGNED_LIFETIME_S`` at most (32 bytes and a float each).
    Used on the encoder's event loop only.
    """

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self._expiries: list[tuple[float, bytes]] = []  # min-heap of (forget at, mac)

    def __len__(self) -> int:
        return len(self._seen)

    def take(self, mac: bytes, expires_s: float, now: float) -> None:
        """Records ``mac`` (valid until ``expires_s``, seconds since the epoch) as used.

        Raises:
            PermissionDeniedError: ``mac`` was taken before.
        """
        while self._expiries and self._expiries[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiries)[1])
        if mac in self._seen:
            raise PermissionDeniedError(
                "Encode refused: this signed request was already taken once (a replay); a decoder signs every "
                "Encode anew"
            )
        self._seen.add(mac)
        heapq.heappush(self._expiries, (expires_s + CLOCK_SKEW_S, mac))


def generate_token_file(path: str) -> str:
    """Writes a new random token (256 bits, URL-safe text) to ``path`` with mode 0600 and returns ``path``.

    Raises:
        OSError: the file cannot be written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)  # O_CREAT's mode applies only to a new file
    return path


def ensure_token_file(path: str) -> bytes:
    """The token in ``path``, after writing a new one there if no file exists (an encoder's first start in a
    deployment whose decoders read the same file, e.g. compose's shared volume). Two processes racing to create it
    end with one token: it is written to a temporary name and linked into place only if ``path`` is still free.

    Raises:
        ValueError: the file cannot be created (no such directory, not writable), or see ``read_token_file``.
    """
    if not os.path.exists(path):
        try:
            scratch = generate_token_file(f"{path}.{secrets.token_hex(4)}.tmp")
        except OSError as exc:
            raise ValueError(f"internal_token_file {path!r} cannot be created: {exc.strerror or exc}") from exc
        try:
            os.link(scratch, path)
            log.info("generated a new internal token in %s", path)
        except FileExistsError:  # another process made it first: theirs stands
            pass
        finally:
            os.unlink(scratch)
    return read_token_file(path)


def read_token_file(path: str) -> bytes:
    """The token in ``path`` (its text, surrounding whitespace stripped).

    Raises:
        ValueError: the file cannot be read, or holds fewer than ``MIN_TOKEN_CHARS`` characters.
    """
    try:
        with open(path, "rb") as f:
            token = f.read(4096).strip()
    except OSError as exc:
        raise ValueError(f"internal_token_file {path!r} cannot be read: {exc.strerror or exc}") from exc
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"internal_token_file {path!r} holds {len(token)} characters; a token needs at least {MIN_TOKEN_CHARS} "
            "(`encdec up` generates one)"
        )
    return token


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health's without the internal token, at its headers, before gRPC reads its body (the
    Encode handler's own check came after a message of up to ``--max-message-bytes`` was received and parsed:
    8 unauthenticated 50 MB Encodes took an encoder from 555 MB to 1.2 GB, held; issue 34 break test).

    Args:
        auth: the encoder's ``InternalAuth`` (with a token).
    """

    def __init__(self, auth: InternalAuth) -> None:
        self._auth = auth

    async def intercept_service(self, continuation, handler_call_details):
        from shared.public_auth import is_open_method, refusing_handler

        handler = await continuation(handler_call_details)
        if handler is None or is_open_method(handler_call_details.method):
            return handler
        try:
            self._auth.check_metadata(handler_call_details.invocation_metadata)
        except UnauthenticatedError as exc:
            return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return handler


class InternalAuth:
    """One service's side of the internal token: metadata and signatures (decoder), checks (encoder).

    Args:
        token: the shared secret, or None (no token configured: every check passes, nothing is signed).
    """

    def __init__(self, token: bytes | None) -> None:
        self._token = token
        self._key = hmac.new(token, _TARGET_KEY_LABEL, hashlib.sha256).digest() if token else None
        self.replays = ReplayGuard()  # the encoder's: signatures taken (verify_target)

    @classmethod
    def from_file(cls, path: str, role: str, create: bool = False) -> InternalAuth:
        """Reads ``path`` (empty: no token, logged once as a warning naming ``role``); ``create``: write a new
        token there first if the file does not exist (``ensure_token_file``; the encoder does).

        Raises:
            ValueError: see ``read_token_file`` and ``ensure_token_file``.
        """
        if not path:
            log.warning(
                "%s: no --internal-token-file: Encode accepts any caller that reaches it (any local user can name "
                "a decoder's KV pool); give decoder and encoder the same token file (`encdec up` generates one)",
                role,
            )
            return cls(None)
        return cls(ensure_token_file(path) if create else read_token_file(path))

    @property
    def pair_key(self) -> bytes | None:
        """The key torch_dist pairing signs with (``shared.kv_transport.torch_dist``): HMAC(token, a label of
        its own), never the token itself; None without a token."""
        return hmac.new(self._token, _PAIR_KEY_LABEL, hashlib.sha256).digest() if self._token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def __repr__(self) -> str:  # never the token itself
        return f"InternalAuth(enabled={self.enabled})"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC call metadata carrying the token (None without one)."""
        return ((METADATA_KEY, SCHEME + self._token.decode()),) if self._token else None

    def check_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """Checks a call's metadata for the token, in constant time.

        Raises:
            UnauthenticatedError: a token is configured and the call carries none, or another one.
        """
        if self._token is None:
            return
        sent = [v for k, v in (metadata or ()) if k == METADATA_KEY]
        if not sent:
            raise UnauthenticatedError(f"Encode needs the deployment's internal token: {_SAME_FILE_HINT}")
        value = sent[0].encode() if isinstance(sent[0], str) else bytes(sent[0])
        if not hmac.compare_digest(value, SCHEME.encode() + self._token):
            raise UnauthenticatedError(f"Encode's internal token does not match this encoder's: {_SAME_FILE_HINT}")

    def sign_target(
        self,
        request_id: str,
        transfer_id: int,
        block_ids: Sequence[int],
        target,
        model: str = "",
        *,
        digest: bytes = b"",
        expires_s: float = 0.0,
    ) -> bytes:
        """HMAC-SHA256 (32 bytes) of what a decoder reserved: ids, blocks and ``target`` (a proto ``KVTarget`` or
        ``shared.kv_transport.KVTargetSpec``), the input's ``digest`` (``input_digest``) and ``expires_s`` (seconds
        since the epoch after which the encoder refuses it); ``b""`` without a token."""
        if self._key is None:
            return b""
        message = json.dumps(
            [
                request_id,
                int(transfer_id),
                [int(b) for b in block_ids],
                target.transport,
                target.segment,
                [int(s) for s in target.shape],
                target.dtype,
                target.instance_id,
                model,
                bytes(digest).hex(),
                float(expires_s),
            ],
            separators=(",", ":"),
        ).encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def verify_target(
        self,
        mac: bytes,
        request_id: str,
        transfer_id: int,
        block_ids: Sequence[int],
        target,
        model: str = "",
        *,
        digest: bytes = b"",
        expires_s: float = 0.0,
        now: float | None = None,
    ) -> None:
        """Checks ``mac`` against ``sign_target`` of the same fields, in constant time, then that it is neither
        expired (``expires_s`` more than ``CLOCK_SKEW_S`` before ``now``, default ``time.time()``), nor dated
        more than ``MAX_SIGNED_LIFETIME_S`` ahead, nor taken before (``ReplayGuard``); takes it.

        Raises:
            PermissionDeniedError: a token is configured and ``mac`` is missing or does not match, expired, too
                long-lived, or a replay.
        """
        if self._key is None:
            return
        expected = self.sign_target(
            request_id, transfer_id, block_ids, target, model, digest=digest, expires_s=expires_s
        )
        if not hmac.compare_digest(bytes(mac), expected):
            raise PermissionDeniedError(
                "KV target refused: its signature does not match the request id, transfer id, block ids, target, "
                "input and expiry a decoder of this deployment signed (a segment name or address is no capability)"
            )
        now = time.time() if now is None else now
        if expires_s < now - CLOCK_SKEW_S:
            raise PermissionDeniedError(
                f"Encode refused: its signature expired {now - expires_s:.0f} s ago (the decoder signs each Encode "
                f"for its own deadline; decoder and encoder clocks may differ by at most {CLOCK_SKEW_S:g} s)"
            )
        if expires_s > now + MAX_SIGNED_LIFETIME_S + CLOCK_SKEW_S:
            raise PermissionDeniedError(
                f"Encode refused: its signature claims to live {expires_s - now:.0f} s, past "
                f"{MAX_SIGNED_LIFETIME_S:g} s (or the decoder's clock is ahead of this encoder's)"
            )
        self.replays.take(bytes(mac), expires_s, now)
