"""Abort from any decoder replica: a request owned by another replica is aborted there, through Redis pub/sub.

Every decoder subscribes to its control channel ``{prefix}:control:{replica_id}``
(a daemon thread; after a Redis restart or any connection loss it connects and
subscribes again). An Abort for a request not running here reads the request's
record (``decoder_svc.replicas.request_state``): unknown, terminal, or owned by this
replica -> not aborted; its owner's lease gone (``shared.registry``) -> not
aborted; else the Abort is forwarded::

    PUBLISH {prefix}:control:{owner} {"op": "abort", "request_id": ..., "reply_to": "{prefix}:reply:<uuid>"}

The owner's subscriber hands it to the event loop (``Sessions.abort``: the
request ends with "abort" and its blocks are freed at the engine's next step)
and answers ``LPUSH reply_to "1"`` (aborted) or ``"0"`` (not running there),
``PEXPIRE``\\d 10 s; the asking replica ``BLPOP``\\s the reply for at most
``reply_timeout_s`` (off the event loop). PUBLISH reaching no subscriber, or no
reply in time: not aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

import redis

from decoder_svc.replicas.request_state import RedisUnavailableError, RequestStateStore
from shared.redis_url import REDIS_SOCKET_TIMEOUT_S, bounded_client, redact_url
from shared.registry import ReplicaRegistry

log = logging.getLogger(__name__)

REPLY_TTL_MS = 10_000  # a reply nobody waits for any more expires
REPLY_TIMEOUT_S = 2.0  # how long the asking replica waits for the owner's answer
RESUBSCRIBE_BACKOFF_S = (0.1, 2.0)  # first and longest wait before connecting again after a loss


class ReplicaControl:
    """This decoder's control channel (the owner side) and the forwarding of Aborts to other replicas.

    Args:
        redis_url: the deployment's Redis (resolved: password in it).
        replica_id: this decoder's registry id (its channel's name).
        store: the request-state store (records name their owner).
        registry: the replica registry (is the owner's lease alive?).
        key_prefix: the keys' namespace (as the store's and the registry's).
        reply_timeout_s: how long a forwarded Abort waits for the owner's answer (seconds).
    """

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        store: RequestStateStore,
        registry: ReplicaRegistry,
        key_prefix: str = "encdec",
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.redis_url = redis_url
        self.replica_id = replica_id
        self.store = store
        self.registry = registry
        self.key_prefix = key_prefix
        self.reply_timeout_s = reply_timeout_s
        # BLPOP blocks up to reply_timeout_s: the socket must wait longer than that.
        self._client = bounded_client(redis_url, reply_timeout_s + REDIS_SOCKET_TIMEOUT_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscribed = threading.Event()  # set while the subscription is up (tests wait on it)

    def channel(self, replica_id: str) -> str:
        """The control channel of the decoder ``replica_id``."""
        return f"{self.key_prefix}:control:{replica_id}"

    # -- the owner side ------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], bool]) -> None:
        """Subscribes to this replica's channel on a daemon thread; each abort message runs ``on_abort(request_id)``
        on ``loop`` (True: it was running here and now ends) and its answer goes to the message's ``reply_to``."""
        self._thread = threading.Thread(
            target=self._subscribe_forever, args=(loop, on_abort), name="replica-control", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops the subscriber (within about a second) and closes the connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3)
        self._client.close()

    def wait_subscribed(self, timeout_s: float) -> bool:
        """True once the subscription is up (False after ``timeout_s`` seconds without it)."""
        return self._subscribed.wait(timeout_s)

    def _subscribe_forever(self, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], bool]) -> None:
        backoff = RESUBSCRIBE_BACKOFF_S[0]
        lost = False
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel(self.replica_id))
                self._subscribed.set()
                if lost:
                    log.info("control channel of %s subscribed again", self.replica_id)
                lost, backoff = False, RESUBSCRIBE_BACKOFF_S[0]
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._handle(message["data"], loop, on_abort)
            except Exception as exc:  # noqa: BLE001 - Redis gone, or a message that is not UTF-8: subscribe again
                self._subscribed.clear()
                if not isinstance(exc, redis.RedisError):
                    log.warning(
                        "control channel of %s: unreadable message (%s); subscribing again", self.replica_id, exc
                    )
                    continue
                if not lost:
                    log.warning(
                        "control channel of %s lost (Redis at %s: %s); subscribing again",
                        self.replica_id,
                        redact_url(self.redis_url),
                        exc,
                    )
                lost = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RESUBSCRIBE_BACKOFF_S[1])
            finally:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001 - a dead connection's close
                    pass
        self._subscribed.clear()

    def _handle(self, data: str, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], bool]) -> None:
        """One control message: runs the abort on the event loop, then answers its ``reply_to``."""
        try:
            message = json.loads(data)
            op, request_id, reply_to = message["op"], str(message["request_id"]), str(message["reply_to"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring a malformed control message on %s: %s", self.channel(self.replica_id), exc)
            return
        if op != "abort" or not reply_to.startswith(f"{self.key_prefix}:reply:"):
            log.warning("ignoring control message op %r (reply_to %r)", op, reply_to)
            return
        aborted = False
        try:
            future = asyncio.run_coroutine_threadsafe(_call(on_abort, request_id), loop)
            aborted = bool(future.result(timeout=self.reply_timeout_s))
        except FutureTimeout:
            log.warning(
                "abort of %s forwarded to %s: the event loop did not answer in time", request_id, self.replica_id
            )
        except Exception:  # noqa: BLE001 - answered "not aborted"
            log.exception("abort of %s forwarded to %s failed", request_id, self.replica_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.lpush(reply_to, "1" if aborted else "0")
        pipe.pexpire(reply_to, REPLY_TTL_MS)
        pipe.execute()  # a RedisError here is the subscriber's: it reconnects
        log.info("abort of %s forwarded from another replica: %s", request_id, "aborted" if aborted else "not running")

    # -- the asking side -----------------------------------------------------
    async def abort_elsewhere(self, request_id: str) -> bool:
        """Abort of a request not running here: forwarded to its owner if another live replica owns it.

        Returns:
            True only if the owner answered that it aborted the request.

        Raises:
            UnavailableError: Redis did not answer (``RedisUnavailableError`` / ``RegistryUnavailableError``).
        """
        record = await asyncio.to_thread(self.store.get, request_id)
        if record is None or record.state.is_terminal or not record.owner or record.owner == self.replica_id:
            return False
        if not await asyncio.to_thread(self.registry.is_alive, record.owner):
            return False  # its lease is gone: decoder_svc.replicas.lost_replicas fails the request
        return await asyncio.to_thread(self.forward_abort, record.owner, request_id)

    def forward_abort(self, owner: str, request_id: str) -> bool:
        """Blocking: PUBLISHes an abort to ``owner``'s channel and waits up to ``reply_timeout_s`` for its answer.

        Returns:
            True if the owner aborted it; False if no one listens on the channel, it was not running there, or no
            answer came in time.

        Raises:
            RedisUnavailableError: Redis did not answer.
        """
        reply_to = f"{self.key_prefix}:reply:{uuid.uuid4().hex}"
        message = json.dumps({"op": "abort", "request_id": request_id, "reply_to": reply_to})
        try:
            if self._client.publish(self.channel(owner), message) == 0:
                log.info("abort of %s: its owner %s is not listening", request_id, owner)
                return False
            reply = self._client.blpop([reply_to], timeout=self.reply_timeout_s)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailableError(
                f"Redis at {redact_url(self.redis_url)} is unreachable ({exc}): the abort of {request_id!r} could not "
                f"reach its owner {owner}; retry"
            ) from exc
        if reply is None:
            log.warning(
                "abort of %s: its owner %s did not answer within %.1f s", request_id, owner, self.reply_timeout_s
            )
            return False
        return reply[1] == "1"


async def _call(fn: Callable[[str], bool], request_id: str) -> bool:
    return fn(request_id)
