"""Request state in Redis: one hash per request, validated state transitions.

Any decoder replica can answer ``GetRequest`` from here. Each request is the
hash ``{key_prefix}:request:{request_id}`` with the fields of the proto
``RequestRecord``: request_id, state, model, owner (the id of the decoder
replica running it, ``shared.registry``), created_at, updated_at (unix
seconds, float), prompt_tokens, completion_tokens, finish_reason, error.

Ownership: ``{key_prefix}:owner:{owner}`` is the set of an owner's
non-terminal requests (added at ``create``, removed by the terminal write, in
the same script), so a live replica can fail the requests of a decoder whose
lease expired in one atomic script (``fail_lost_owner``;
``decoder_svc.replicas.lost_replicas``).

Life cycle::

    QUEUED -> ENCODING -> DECODING -> FINISHED | ABORTED | FAILED
    DECODING -> QUEUED          (preempted, waits to be rescheduled)
    QUEUED | ENCODING -> ABORTED | FAILED

A non-terminal state may be set again (to update the token counts). Terminal
states are final and give the hash an expiry (``finished_ttl_s``) so records do
not pile up. Each write is one Lua script (check + write + expire, atomic, one
round trip; ``decoder_svc.replicas.request_state_lua``); ``set_state_many`` and ``get_many`` pipeline many requests
into one round trip, so the decode loop writes once per step, never once per token.

Redis lost a record (restarted without persistence) while its request ran: a
write given the record as created (``created=``) writes it whole, so every
record a replica knew goes on (a queued request's ENCODING / DECODING as much as
its final state: issue 34's break test saw 5 of 12 queued requests fail as
"record vanished" once an emptied Redis was back); a write without it to a
missing record raises ``UnknownRequestError``.

Redis faults: every call has a socket timeout (``shared.redis_url.bounded_client``) and
at most one retry, so a stopped or frozen Redis fails a call
within a few seconds, never hangs it; the failure is a ``RedisUnavailableError``
(UNAVAILABLE) naming the URL. ``probe`` is the health check's short PING.

Over 300 lines: the state machine, the record and the Redis store (its field codec) are one schema and change
together; the Lua scripts are ``decoder_svc.replicas.request_state_lua``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from decoder_svc.replicas.request_state_lua import CREATE_LUA, DELETE_LUA, FAIL_LOST_OWNER_LUA, SET_STATE_LUA
from shared.errors import UnavailableError
from shared.redis_url import bounded_client, credentials_refused, redact_url

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0  # the health probe's PING


class RequestState(enum.Enum):
    """Request states; names and values match proto ``encdec.v1.RequestState``
    (``REQUEST_STATE_<name>``; ``UNSPECIFIED`` = 0 is not a state a request has)."""

    QUEUED = 1
    ENCODING = 2
    DECODING = 3
    FINISHED = 4
    ABORTED = 5
    FAILED = 6

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})

# new state -> states it may be entered from (the one transition table).
_ALLOWED_FROM: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.QUEUED, RequestState.DECODING}),
    RequestState.ENCODING: frozenset({RequestState.QUEUED, RequestState.ENCODING}),
    RequestState.DECODING: frozenset({RequestState.QUEUED, RequestState.ENCODING, RequestState.DECODING}),
    RequestState.FINISHED: frozenset({RequestState.DECODING}),
    RequestState.ABORTED: frozenset({RequestState.QUEUED, RequestState.ENCODING, RequestState.DECODING}),
    RequestState.FAILED: frozenset({RequestState.QUEUED, RequestState.ENCODING, RequestState.DECODING}),
}

FINISH_REASONS = ("stop", "length", "abort", "")
_INT_FIELDS = ("prompt_tokens", "completion_tokens", "audio_bytes", "finals")
_STR_FIELDS = ("finish_reason", "error")
UPDATABLE_FIELDS = _INT_FIELDS + _STR_FIELDS


class RequestStateError(Exception):
    """Base class of request-state store errors."""


class RedisUnavailableError(UnavailableError):
    """Redis did not answer (refused, reset or timed out): UNAVAILABLE, the message names its URL."""


class RequestExistsError(RequestStateError):
    """``create`` was called with a request id that already has a record."""


class UnknownRequestError(RequestStateError, KeyError):
    """No record for the request id (never created, deleted or expired)."""


class InvalidTransitionError(RequestStateError):
    """The requested state change is not allowed from the current state (``current``; terminal when another
    replica ended the request, e.g. failed it after this one's lease expired)."""

    def __init__(self, message: str, current: RequestState | None = None) -> None:
        super().__init__(message)
        self.current = current


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One request's record, as stored (mirrors proto ``RequestRecord``)."""

    request_id: str
    state: RequestState
    model: str
    created_at: float  # unix seconds
    updated_at: float  # unix seconds
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""  # "stop", "length", "abort" or ""
    error: str = ""
    owner: str = ""  # decoder replica id (shared.registry); "" for records made without one
    audio_bytes: int = 0  # realtime streams: audio bytes received so far
    finals: int = 0  # realtime streams: final segments sent so far


class RequestStateStore:
    """Request records in Redis (see the module docstring for the life cycle).

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
        key_prefix: namespace of the keys, ``{key_prefix}:request:{id}``.
        finished_ttl_s: seconds a record lives after reaching a terminal state.
    """

    def __init__(self, redis_url: str, key_prefix: str = "encdec", finished_ttl_s: float = 3600) -> None:
        if finished_ttl_s <= 0:
            raise ValueError(f"finished_ttl_s must be > 0, got {finished_ttl_s}")
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.finished_ttl_s = finished_ttl_s
        self._client = bounded_client(redis_url)
        self._probe_client: redis.Redis | None = None
        self._create = self._client.register_script(CREATE_LUA)
        self._set_state = self._client.register_script(SET_STATE_LUA)
        self._delete = self._client.register_script(DELETE_LUA)
        self._fail_lost_owner = self._client.register_script(FAIL_LOST_OWNER_LUA)

    def key(self, request_id: str) -> str:
        """The Redis key of a request's hash."""
        return f"{self.key_prefix}:request:{request_id}"

    def owner_key(self, owner: str) -> str:
        """The Redis key of the set of ``owner``'s non-terminal request ids."""
        return f"{self.key_prefix}:owner:{owner}"

    def ping(self) -> bool:
        """True if Redis answers.

        Raises:
            UnavailableError: Redis cannot be reached (the message names the URL).
        """
        try:
            return bool(self._client.ping())
        except redis.RedisError as exc:  # refused, timed out, wrong password, no such database ...
            if credentials_refused(exc):
                raise UnavailableError(
                    f"Redis at {redact_url(self.redis_url)} refused this service's credentials ({exc}): put the "
                    "right password in --redis-url (redis://[user]:password@host:port/db) or --redis-password-file"
                ) from exc
            raise UnavailableError(
                f"cannot reach Redis at {redact_url(self.redis_url)} ({exc}): start redis-server "
                "or pass the right --redis-url"
            ) from exc

    def probe(self) -> str | None:
        """One PING within ``PROBE_TIMEOUT_S`` seconds, no retry (the health check's): None if Redis answered,
        else why not (names the URL, never the password)."""
        if self._probe_client is None:
            self._probe_client = redis.Redis.from_url(
                self.redis_url,
                socket_timeout=PROBE_TIMEOUT_S,
                socket_connect_timeout=PROBE_TIMEOUT_S,
                retry=Retry(ExponentialWithJitterBackoff(), 0),
            )
        try:
            self._probe_client.ping()
            return None
        except redis.RedisError as exc:
            return f"Redis at {redact_url(self.redis_url)} is unreachable ({exc})"

    @contextlib.contextmanager
    def _reachable(self):
        """Turns Redis's connection errors, timeouts and a full Redis (OOM under ``noeviction``) into a
        ``RedisUnavailableError`` a client can act on (UNAVAILABLE; a final state is then written once Redis takes
        it, ``Sessions.flush_unrecorded``)."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailableError(
                f"Redis at {redact_url(self.redis_url)} is unreachable ({exc}): the request state cannot be "
                "recorded or read; retry the request once Redis is back, or send it to another replica"
            ) from exc
        except redis.exceptions.OutOfMemoryError as exc:  # maxmemory with noeviction: as good as unreachable
            raise RedisUnavailableError(
                f"Redis at {redact_url(self.redis_url)} is full (its maxmemory, policy noeviction): the request "
                "state cannot be recorded; retry later (finished records expire and free room), or raise Redis's "
                "maxmemory"
            ) from exc

    def close(self) -> None:
        self._client.close()
        if self._probe_client is not None:
            self._probe_client.close()

    def __enter__(self) -> RequestStateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, request_id: str, model: str, owner: str = "") -> RequestRecord:
        """Records a new request in state QUEUED, owned by the decoder replica ``owner`` (its id; "" = none), and
        adds it to the owner's set, in one atomic script.

        Raises:
            ValueError: empty request id.
            RequestExistsError: a record with this id exists.
            RedisUnavailableError: Redis did not answer.
        """
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        now = time.time()
        with self._reachable():
            created = self._create(
                keys=[self.key(request_id), self.owner_key(owner)],
                args=[request_id, RequestState.QUEUED.name, model, repr(now), owner],
            )
        if not created:
            raise RequestExistsError(f"request id {request_id!r} already exists; request ids must be unique")
        return RequestRecord(request_id, RequestState.QUEUED, model, now, now, owner=owner)

    def set_state(
        self, request_id: str, state: RequestState, created: RequestRecord | None = None, **fields: Any
    ) -> RequestState | None:
        """Moves a request to ``state`` and updates ``fields`` in one atomic step.

        Args:
            request_id: the request.
            state: the new state; a terminal state sets the record's expiry and removes the id from its owner's set.
            created: the record as ``create`` returned it: a write that finds no record (Redis lost it) writes the
                whole record from it (model, owner, created_at) and ``fields``. None: no such upsert.
            **fields: any of prompt_tokens, completion_tokens, audio_bytes, finals (ints >= 0),
                finish_reason ("stop", "length", "abort", ""), error (str).

        Returns:
            The state the request was in before; None if the record was written anew (``created``).

        Raises:
            ValueError: unknown field or bad value.
            UnknownRequestError: no record (never created, deleted or expired).
            InvalidTransitionError: ``state`` cannot follow the current state.
            RedisUnavailableError: Redis did not answer.
        """
        return self.set_state_many([(request_id, state, fields)], {request_id: created} if created else None)[0]

    def set_state_many(
        self,
        updates: Sequence[tuple[str, RequestState, dict[str, Any]]],
        created: Mapping[str, RequestRecord] | None = None,
    ) -> list[RequestState | None]:
        """``set_state`` for many requests in one pipelined round trip.

        Each update is applied atomically on its own; all are attempted, then
        the first failure (if any) is raised. Returns the previous states (None: written anew).

        Args:
            updates: ``(request_id, state, fields)`` each.
            created: records as created, by request id (``set_state``'s ``created``), for the upserts.

        Raises:
            RedisUnavailableError: Redis did not answer (then none, some or all were applied).
        """
        if not updates:
            return []
        created = created or {}
        pipe = self._client.pipeline(transaction=False)
        now = repr(time.time())
        for request_id, state, fields in updates:
            state = RequestState(state)
            ttl_ms = int(self.finished_ttl_s * 1000) if state.is_terminal else 0
            allowed = ",".join(s.name for s in _ALLOWED_FROM[state])
            base = created.get(request_id)
            upsert = ["1", base.model, base.owner, repr(base.created_at)] if base else ["0", "", "", ""]
            owner_prefix = self.owner_key("")
            args = [state.name, now, ttl_ms, allowed, owner_prefix, request_id, *upsert, *_encode_fields(fields)]
            self._set_state(keys=[self.key(request_id)], args=args, client=pipe)
        with self._reachable():
            results = pipe.execute()
        previous: list[RequestState | None] = []
        error: RequestStateError | None = None
        for (request_id, state, _), (code, cur) in zip(updates, results):
            if code == 1:
                previous.append(RequestState[cur])
                continue
            if code == 2:
                log.warning(
                    "request %s had no record (Redis lost it: restarted without persistence?); wrote its %s "
                    "record anew",
                    request_id,
                    RequestState(state).name,
                )
                previous.append(None)
                continue
            if code == 0:
                err: RequestStateError = UnknownRequestError(
                    f"no record for request id {request_id!r} (never created, deleted or expired)"
                )
            else:
                err = InvalidTransitionError(
                    f"request {request_id!r}: cannot go from {cur} to {RequestState(state).name}", RequestState[cur]
                )
            error = error or err
            previous.append(RequestState[cur] if cur else None)  # type: ignore[arg-type]
        if error is not None:
            raise error
        return previous

    def get(self, request_id: str) -> RequestRecord | None:
        """The request's record, or None if there is none (or it expired)."""
        return self.get_many([request_id])[0]

    def get_many(self, request_ids: Iterable[str]) -> list[RequestRecord | None]:
        """Records of many requests in one pipelined round trip (None where absent).

        Raises:
            RedisUnavailableError: Redis did not answer.
        """
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hgetall(self.key(request_id))
        with self._reachable():
            hashes = pipe.execute()
        return [_decode_record(h) if h else None for h in hashes]

    def ttl_s(self, request_id: str) -> float | None:
        """Seconds until the record expires; None if it has no expiry or no record."""
        with self._reachable():
            ms = self._client.pttl(self.key(request_id))
        return ms / 1000.0 if ms >= 0 else None

    def delete(self, request_id: str) -> bool:
        """Deletes the record (and its owner-set entry); True if one existed."""
        with self._reachable():
            return bool(self._delete(keys=[self.key(request_id)], args=[self.owner_key(""), request_id]))

    def owned(self, owner: str) -> set[str]:
        """Ids of ``owner``'s non-terminal requests (its owner set)."""
        with self._reachable():
            return set(self._client.smembers(self.owner_key(owner)))

    def fail_lost_owner(self, owner: str, error: str, lease_key: str, members_key: str) -> int:
        """Fails every non-terminal request of the decoder replica ``owner`` whose lease expired, in one script.

        Each such record becomes FAILED with ``error`` (and the finished expiry); then the owner set is deleted
        and ``owner`` removed from the registry's member set ``members_key``. Nothing is done if its lease key
        ``lease_key`` exists again (it renewed in time). Two replicas running this at once: one fails the
        requests, the other finds nothing.

        Returns:
            How many requests it failed; -1 if the lease exists again.

        Raises:
            RedisUnavailableError: Redis did not answer.
        """
        ttl_ms = int(self.finished_ttl_s * 1000)
        with self._reachable():
            return int(
                self._fail_lost_owner(
                    keys=[self.owner_key(owner), lease_key, members_key],
                    args=[owner, repr(time.time()), ttl_ms, error, self.key("")],
                )
            )


def _encode_fields(fields: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in fields.items():
        if name in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
            out += [name, str(value)]
        elif name == "finish_reason":
            if value not in FINISH_REASONS:
                raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {value!r}")
            out += [name, value]
        elif name == "error":
            out += [name, str(value)]
        else:
            raise ValueError(f"unknown request field {name!r}; updatable fields: {', '.join(UPDATABLE_FIELDS)}")
    return out


def _decode_record(h: dict[str, str]) -> RequestRecord:
    return RequestRecord(
        request_id=h["request_id"],
        state=RequestState[h["state"]],
        model=h.get("model", ""),
        created_at=float(h["created_at"]),
        updated_at=float(h["updated_at"]),
        prompt_tokens=int(h.get("prompt_tokens") or 0),
        completion_tokens=int(h.get("completion_tokens") or 0),
        finish_reason=h.get("finish_reason", ""),
        error=h.get("error", ""),
        owner=h.get("owner", ""),
        audio_bytes=int(h.get("audio_bytes") or 0),
        finals=int(h.get("finals") or 0),
    )
