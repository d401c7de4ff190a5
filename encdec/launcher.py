"""Starts Redis, the encoder and the decoder as separate processes, and stops them.

Used by ``encdec up``, ``encdec demo`` and the integration tests, so all three
run the services exactly the same way.

Over 300 lines: ``Services`` and ``encoder_service`` share the process helpers (port check,
health wait, stop) and the restart-on-port-taken logic; splitting them would separate one start/stop
procedure.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encdec.redis_server import free_port, free_ports
from shared.errors import BIND_ERROR_EXIT, ServicesError
from shared.internal_auth import generate_token_file

log = logging.getLogger(__name__)

# How many times Services.start picks new free ports after losing one to another process.
BIND_ATTEMPTS = 3
# The services Services hands its Redis URL to (as ENCDEC_REDIS_URL: Services._child_env).
REDIS_CLIENTS = ("decoder",)
# The health wait's channel retries a refused connection every 100-200 ms. gRPC's default backoff (1 s, x1.6 each
# attempt) would leave a service that came up after ~10 s of model loading unseen for up to 6 s more.
HEALTH_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Checks that nothing listens on ``host:port`` (connections lingering in TIME_WAIT do not count).

    Services bind only after loading their model; without this check a fixed port that another process
    serves (a second ``encdec up``) would pass the health check through that process.

    Raises:
        ServicesError: the port is taken (the message names it).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ServicesError(
                f"{host}:{port} is already in use by another process (another `encdec up`?): "
                "stop it or choose another port"
            ) from exc


def shutdown_timeout_s(service_args: list[str], margin_s: float = 7.0) -> float:
    """How long to wait for a decoder started as ``encdec <service_args>`` (``["serve-decoder", ...]``) to exit
    after SIGTERM: the ``shutdown_grace_s`` it drains for, read as the decoder reads it (its flags, abbreviated or
    not, over the ``ENCDEC_*`` environment it inherits, over the default), plus ``margin_s`` to end the rest."""
    from encdec.parser import build_parser
    from shared.config import DecoderServiceConfig, config_from

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse prints usage for a bad flag
            parsed = build_parser().parse_args(service_args)
        grace = config_from(DecoderServiceConfig, parsed).shutdown_grace_s
    except (SystemExit, ValueError):  # arguments the decoder refuses: it never started
        grace = DecoderServiceConfig.shutdown_grace_s
    return grace + margin_s


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM to each running process, last started first; SIGKILL whatever outlives ``timeout_s`` (seconds)."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "%s did not exit within %.0f s of SIGTERM: killed",
                " ".join(map(str, proc.args[-8:])) if isinstance(proc.args, list) else proc.args,
                timeout_s,
            )
            proc.kill()
            proc.wait()


def wait_healthy(
    address: str,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Polls the standard gRPC health service at ``address`` until SERVING; ``credentials``: over TLS
    (``shared.tls.ClientSecurity.credentials``; health needs no bearer token).

    Raises:
        ServicesError: ``proc`` exited first, or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    channel = (
        grpc.insecure_channel(address, options=HEALTH_CHANNEL_OPTIONS)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=HEALTH_CHANNEL_OPTIONS)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ServicesError(f"service for {address} exited with code {proc.returncode} before becoming healthy")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise ServicesError(f"service at {address} not healthy after {timeout_s:.0f} s")


def wait_http_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Polls ``GET <url>/health`` (the HTTP gateway's) until 200.

    Raises:
        ServicesError: ``proc`` exited first, or ``timeout_s`` passed.
    """
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServicesError(f"service for {url} exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise ServicesError(f"HTTP gateway at {url} not healthy after {timeout_s:.0f} s")


@dataclass
class Services:
    """Redis + encoder + decoder processes.

    Args:
        model: model name or directory for both services.
        redis_url: an existing Redis (its URL may carry a password); None starts a local ``redis-server`` with
            a generated password (``LocalRedisServer``; ``redis_url`` is then its URL, password included). The
            decoder gets it as ``ENCDEC_REDIS_URL`` in its environment, not on its command line.
        encoder_port / decoder_port: 0 picks free ports.
        extra_decoder_args / extra_encoder_args: more CLI flags.
        log_dir: where each service's stdout/stderr goes; None inherits ours.
        log_level: the services' log level.
        embed_model: also start an embed service (an encoder service of this encoder-only model) on
            ``embed_port`` (0 picks a free one), its Prometheus ``/metrics`` on 9402.
        http_port: also start the HTTP gateway (``encdec serve-http``) on this port, in front of the decoder
            and the embed service (0 picks a free port; None starts none). ``extra_http_args``: more flags.
        internal_token: generate an internal token (``shared.internal_auth``) in a private temporary
            directory and start both services with ``--internal-token-file`` (``internal_token_file``, removed
            at ``stop``); ``encdec up`` and ``demo`` do. With it, a public port bound beyond loopback (``--host`` in
            a service's extra args, or ``ENCDEC_HOST``) never serves without a secret (issue 34 item 1): the
            decoder and embed service get a generated bearer token (``--auth-token-file``, ``public_token_file``)
            that the gateway sends (``--backend-token-file``), and the gateway a generated API key
            (``ENCDEC_API_KEY`` in its environment, the key in ``api_key_file``), unless one of their own is given.
    """

    model: str | None = None
    redis_url: str | None = None
    encoder_port: int = 0
    decoder_port: int = 0
    extra_encoder_args: list[str] = field(default_factory=list)
    extra_decoder_args: list[str] = field(default_factory=list)
    log_dir: str | None = None
    startup_timeout_s: float = 180.0
    log_level: str = "INFO"
    embed_model: str | None = None
    embed_port: int = 0
    http_port: int | None = None
    extra_http_args: list[str] = field(default_factory=list)
    internal_token: bool = False
    internal_token_file: str | None = None
    public_token_file: str | None = None
    api_key_file: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    _redis: object = None
    _named: dict[str, tuple[subprocess.Popen, list[str], str]] = field(default_factory=dict)

    @property
    def encoder_address(self) -> str:
        return f"127.0.0.1:{self.encoder_port}"

    @property
    def decoder_address(self) -> str:
        return f"127.0.0.1:{self.decoder_port}"

    @property
    def embed_address(self) -> str:
        return f"127.0.0.1:{self.embed_port}"

    @property
    def http_url(self) -> str:
        """The gateway's base URL (``http://127.0.0.1:<port>``); its OpenAI API is under ``/v1``."""
        return f"http://127.0.0.1:{self.http_port}"

    def _address(self, name: str) -> str:
        return {"encoder": self.encoder_address, "decoder": self.decoder_address, "embed": self.embed_address}.get(
            name, self.http_url
        )

    def _child_env(self, name: str) -> dict[str, str] | None:
        """The environment of service ``name``: ours, plus ``ENCDEC_REDIS_URL`` for the services in
        ``REDIS_CLIENTS``. The URL carries the password, so it travels in the environment (readable by this user
        only, ``/proc/<pid>/environ``), never as ``--redis-url`` on a command line, which every local user reads."""
        env = None
        if name in REDIS_CLIENTS and self.redis_url:
            env = {**os.environ, "ENCDEC_REDIS_URL": self.redis_url}
        if name == "http" and self.api_key_file is not None:
            with open(self.api_key_file) as f:
                env = {**(env or os.environ), "ENCDEC_API_KEY": f.read().strip()}
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "encdec.cli", "--log-level", self.log_level, *args]
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            env=self._child_env(name),
        )
        self.procs.append(proc)
        self._named[name] = (proc, args, self._address(name))
        return proc

    def process(self, name: str) -> subprocess.Popen:
        """The last process started as the ``encoder``, ``decoder``, ``embed`` or ``http`` (running or exited).

        Raises:
            KeyError: no service of that name was started.
        """
        return self._named[name][0]

    def exited(self) -> dict[str, int]:
        """``{name: exit code}`` of the services whose last process is no longer running."""
        return {name: proc.returncode for name, (proc, _, _) in self._named.items() if proc.poll() is not None}

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 15.0) -> None:
        """Sends ``sig`` (default SIGKILL: a crash) to the ``encoder`` or ``decoder`` process and waits for it to exit."""
        proc = self.process(name)
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(timeout=timeout_s)
        self.procs.remove(proc)

    def restart(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kills the ``encoder`` or ``decoder`` (if still running) and starts it again with the same arguments and port.

        Raises:
            ServicesError: the new process did not become healthy in time.
        """
        proc, args, address = self._named[name]
        if proc in self.procs:
            self.kill(name, sig)
        wait = wait_http_healthy if name == "http" else wait_healthy
        wait(address, self.startup_timeout_s, self._spawn(name, args))

    def start(self) -> Services:
        """Starts everything and waits for health.

        Ports left at 0 are picked free; should another process take one before
        the service binds it (the service exits with ``BIND_ERROR_EXIT``), both
        services start again on newly picked ports, up to ``BIND_ATTEMPTS`` times.

        Raises:
            ServicesError: a fixed port is taken, or a service exited or did not become healthy in time
                (everything started is stopped again).
        """
        ports = {"encoder": self.encoder_port, "decoder": self.decoder_port}
        if self.embed_model:
            ports["embed"] = self.embed_port
        if self.http_port is not None:
            ports["http"] = self.http_port
        auto = {name: port == 0 for name, port in ports.items()}
        for name, port in ports.items():
            if not auto[name]:
                check_port_free(port)
        try:
            if self.redis_url is None:
                from encdec.redis_server import LocalRedisServer

                self._redis = LocalRedisServer()
                self._redis.start()
                self.redis_url = self._redis.url
            for attempt in range(1, BIND_ATTEMPTS + 1):
                picked = iter(free_ports(sum(auto.values())))
                for name in ports:
                    if auto[name]:
                        setattr(self, f"{name}_port", next(picked))
                try:
                    self._start_services()
                    return self
                except ServicesError:
                    # Only a service on a port picked here starts again on another; a fixed port stays an error.
                    exited = self.exited()
                    lost_auto_port = any(exited.get(name) == BIND_ERROR_EXIT for name in ports if auto[name])
                    if not lost_auto_port or attempt == BIND_ATTEMPTS:
                        raise
                    stop_processes(self.procs)
                    self.procs.clear()
        except BaseException:
            self.stop()
            raise
        return self

    def _token_args(self) -> list[str]:
        """``--internal-token-file`` for both services, the file generated once (``internal_token``)."""
        given = any(a.startswith("--internal-token-file") for a in self.extra_encoder_args + self.extra_decoder_args)
        if not self.internal_token or given:  # a file of the caller's own: they pass it to both
            return []
        if self.internal_token_file is None:
            self.internal_token_file = generate_token_file(
                os.path.join(tempfile.mkdtemp(prefix="encdec-token-"), "internal-token")  # mode 0700
            )
        return ["--internal-token-file", self.internal_token_file]

    def _secret_dir(self) -> str:
        """The private (0700) temporary folder of the secrets generated here (removed at ``stop``)."""
        if self.internal_token_file is not None:
            return os.path.dirname(self.internal_token_file)
        for path in (self.public_token_file, self.api_key_file):
            if path is not None:
                return os.path.dirname(path)
        return tempfile.mkdtemp(prefix="encdec-token-")

    def _public_secrets(self) -> tuple[list[str], list[str]]:
        """``(token args of the decoder and embed service, the gateway's backend-token args)``: a generated
        public token when a gRPC port is bound beyond loopback without one of the caller's own (``internal_token``
        deployments: ``encdec up``); also generates the gateway's API key when its port is bound beyond loopback
        without one (``api_key_file``)."""
        if not self.internal_token:
            return [], []
        if self.http_port is not None and not _is_loopback(_host_of(self.extra_http_args)):
            has_key = os.environ.get("ENCDEC_API_KEY") or _flag_given(self.extra_http_args, "--api-key")
            if not has_key and self.api_key_file is None:
                self.api_key_file = generate_token_file(os.path.join(self._secret_dir(), "api-key"))
        own = os.environ.get("ENCDEC_AUTH_TOKEN") or os.environ.get("ENCDEC_AUTH_TOKEN_FILE")
        own = own or _flag_given(self.extra_decoder_args, "--auth-token-file", "--auth-token")
        public = not _is_loopback(_host_of(self.extra_decoder_args)) or (
            self.embed_model is not None and not _is_loopback(_host_of([]))
        )
        if own or not public:
            return [], []
        if self.public_token_file is None:
            self.public_token_file = generate_token_file(os.path.join(self._secret_dir(), "public-token"))
        return ["--auth-token-file", self.public_token_file], ["--backend-token-file", self.public_token_file]

    def _start_services(self) -> None:
        model = ["--model", self.model] if self.model else []
        token = self._token_args()
        public_token, backend_token = self._public_secrets()
        # internal: only this host's decoder calls it (encoder_address is loopback), whatever ENCDEC_HOST opens for
        # the public ports; an explicit --host in extra_encoder_args (later on its command line) still wins
        encoder_args = ["--host", "127.0.0.1", *self.extra_encoder_args]
        encoder = self._spawn(
            "encoder",
            [
                "serve-encoder",
                "--port",
                str(self.encoder_port),
                *model,
                *token,
                *_local_metrics(encoder_args),
                *encoder_args,
            ],
        )
        decoder = self._spawn(
            "decoder",
            [
                "serve-decoder",
                "--port",
                str(self.decoder_port),
                "--encoder-address",
                self.encoder_address,
                *model,
                *token,
                *public_token,
                *_local_metrics(self.extra_decoder_args),
                *self.extra_decoder_args,
            ],
        )
        embed = None
        if self.embed_model:
            embed = self._spawn(
                "embed",
                # Its own metrics port: the encoder's default (9401) is taken by the encoder.
                [
                    "serve-encoder",
                    "--port",
                    str(self.embed_port),
                    "--model",
                    self.embed_model,
                    "--metrics-port",
                    "9402",
                    *public_token,
                    *_local_metrics([]),
                ],
            )
        wait_healthy(self.encoder_address, self.startup_timeout_s, encoder)
        wait_healthy(self.decoder_address, self.startup_timeout_s, decoder)
        if embed is not None:
            wait_healthy(self.embed_address, self.startup_timeout_s, embed)
        if self.http_port is not None:
            backends = ["--decoder-address", self.decoder_address]
            if self.embed_model:
                backends += ["--embed-address", self.embed_address]
            http = self._spawn(
                "http", ["serve-http", "--port", str(self.http_port), *backends, *backend_token, *self.extra_http_args]
            )
            wait_http_healthy(self.http_url, self.startup_timeout_s, http)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops the decoder, then the encoder: SIGTERM, then SIGKILL if it outlives its timeout.

        The decoder gets its ``shutdown_grace_s`` (``shutdown_timeout_s``) plus a margin, at least ``timeout_s``: it
        drains its running requests while the encoder still serves them; the encoder gets ``timeout_s``.
        """
        decoder = self._named.get("decoder", (None, [], ""))
        for proc in reversed(self.procs):  # last started first: the decoder, then the encoder
            wait_s = max(timeout_s, shutdown_timeout_s(decoder[1])) if proc is decoder[0] else timeout_s
            stop_processes([proc], wait_s)
        self.procs.clear()
        if self._redis is not None:
            with contextlib.suppress(Exception):
                self._redis.stop()
            self._redis = None
        for path in (self.internal_token_file, self.public_token_file, self.api_key_file):
            if self.internal_token and path is not None:  # generated here: gone with the services
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        if self.internal_token:
            self.internal_token_file = self.public_token_file = self.api_key_file = None

    def __enter__(self) -> Services:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _flag_given(args: list[str], *flags: str) -> bool:
    """True when ``args`` hold one of ``flags`` (``--flag value`` or ``--flag=value``)."""
    return any(a in flags or a.split("=", 1)[0] in flags for a in args)


def _local_metrics(args: list[str]) -> list[str]:
    """``--metrics-host 127.0.0.1`` for a service started with ``args`` that binds beyond loopback, unless a metrics
    host is given (``--metrics-host`` in ``args``, ``ENCDEC_METRICS_HOST``): ``/metrics`` is plain HTTP without a
    token, so it stays on loopback unless asked for (issue 34)."""
    if _is_loopback(_host_of(args)) or os.environ.get("ENCDEC_METRICS_HOST") or _flag_given(args, "--metrics-host"):
        return []
    return ["--metrics-host", "127.0.0.1"]


def _host_of(args: list[str]) -> str:
    """The ``--host`` a service started with ``args`` binds: the last one in ``args``, else ``ENCDEC_HOST``, else
    ``127.0.0.1`` (the services' default)."""
    host = os.environ.get("ENCDEC_HOST", "127.0.0.1")
    for i, a in enumerate(args):
        if a == "--host" and i + 1 < len(args):
            host = args[i + 1]
        elif a.startswith("--host="):
            host = a.split("=", 1)[1]
    return host


def _is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``); False for ``0.0.0.0``, names..."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def encoder_service(
    model: str, extra_args: list[str] | None = None, log_level: str = "WARNING", startup_timeout_s: float = 120.0
):
    """Starts only the encoder service (e.g. an encoder-only model's EmbedService) and yields its address.

    Like ``Services.start``, it starts again on another free port if its port was taken before it bound it.

    Raises:
        ServicesError: it exited or did not become healthy in time.
    """
    args = ["serve-encoder", "--model", model, *(extra_args or [])]
    with _one_service(args, log_level, startup_timeout_s, lambda port: f"127.0.0.1:{port}", wait_healthy) as address:
        yield address


@contextlib.contextmanager
def _one_service(args: list[str], log_level: str, startup_timeout_s: float, address_of, wait, env=None):
    """``encdec <args> --port P`` on a free port P (picked again if it was taken before the service bound it, up to
    ``BIND_ATTEMPTS`` times); yields ``address_of(P)`` once ``wait(address, timeout_s, proc)`` passes; stops it.

    Raises:
        ServicesError: it exited or did not become healthy in time.
    """
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = free_port()
        cmd = [sys.executable, "-m", "encdec.cli", "--log-level", log_level, *args[:1], "--port", str(port), *args[1:]]
        proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        address = address_of(port)
        try:
            wait(address, startup_timeout_s, proc)
            break
        except BaseException:
            stop_processes([proc])
            if proc.returncode != BIND_ERROR_EXIT or attempt == BIND_ATTEMPTS:
                raise
    try:
        yield address
    finally:
        stop_processes([proc])


@contextlib.contextmanager
def http_gateway(
    decoder_addresses: list[str] | None = None,
    embed_addresses: list[str] | None = None,
    extra_args: list[str] | None = None,
    log_level: str = "WARNING",
    startup_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
):
    """Starts only the HTTP gateway (``encdec serve-http``) in front of running services; yields its base URL.

    Like ``encoder_service``, it starts again on another free port if its port was taken before it bound it.
    ``env``: the gateway's environment (default: ours), e.g. with ``ENCDEC_API_KEY``.

    Raises:
        ServicesError: it exited or did not become healthy in time.
    """
    backends = []
    if decoder_addresses:
        backends += ["--decoder-address", ",".join(decoder_addresses)]
    if embed_addresses:
        backends += ["--embed-address", ",".join(embed_addresses)]
    args = ["serve-http", *backends, *(extra_args or [])]
    with _one_service(
        args, log_level, startup_timeout_s, lambda port: f"http://127.0.0.1:{port}", wait_http_healthy, env
    ) as url:
        yield url
