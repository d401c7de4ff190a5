"""The Redis URL a service connects with (``redis_url`` with the password of ``redis_password_file`` put in), the
URL as messages and logs show it (``redact_url``: never the password), and the bounded client every part uses.

Kubernetes and compose hand secrets over as files (or as variables); a URL in a
manifest should not carry the password itself. ``resolve_redis_url`` keeps the
URL's user name (a Redis 6 ACL user) and host, and replaces its password with
the file's content (surrounding whitespace stripped).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

# Bounds on one Redis call: a stopped Redis refuses at once, a frozen one costs at most
# (1 + REDIS_RETRIES) * REDIS_SOCKET_TIMEOUT_S plus the backoff (redis-py's default would retry 10 times
# after 5 s timeouts: nearly a minute).
REDIS_SOCKET_TIMEOUT_S = 2.0
REDIS_RETRIES = 1  # one retry: a connection dropped by a Redis restart is opened again


def resolve_redis_url(url: str, password_file: str = "") -> str:
    """``url`` with the password read from ``password_file`` (empty: ``url`` unchanged).

    Raises:
        ValueError: the file cannot be read or is empty, or ``url`` is empty while a password file is set.
    """
    if not password_file:
        return url
    if not url:
        raise ValueError("redis_password_file is set but redis_url is empty: set redis_url too")
    try:
        password = Path(password_file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read redis_password_file {password_file}: {exc.strerror}") from exc
    if not password:
        raise ValueError(f"redis_password_file {password_file} is empty")
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = quote(parts.username or "", safe="")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def bounded_client(url: str, read_timeout_s: float = REDIS_SOCKET_TIMEOUT_S) -> redis.Redis:
    """A ``decode_responses`` client whose calls fail within about ``(1 + REDIS_RETRIES) x read_timeout_s``
    (connecting within ``REDIS_SOCKET_TIMEOUT_S``), retried once with jittered backoff: a restarted Redis is
    reconnected, a stopped or frozen one never hangs a caller. ``read_timeout_s`` above a blocking command's own
    timeout (BLPOP) keeps the socket open for it."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=read_timeout_s,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), REDIS_RETRIES),
    )


def credentials_refused(exc: BaseException) -> bool:
    """True when Redis refused the connection's credentials (no password where one is needed, a wrong one, an
    unknown ACL user), as opposed to being unreachable."""
    if isinstance(exc, redis.AuthenticationError):
        return True
    text = str(exc)
    return isinstance(exc, redis.ResponseError) and any(
        marker in text for marker in ("NOAUTH", "WRONGPASS", "invalid username-password", "HELLO must be called")
    )
