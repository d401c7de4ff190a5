"""Runs compose.yaml's services as local processes (the translator behind tests/app/test_compose.py).

No Docker engine runs on our machines, so this takes the project
``compose_file.load_project`` read (as ``docker compose up`` would) and runs each
service of the active profiles as a process on this machine:

* a service with ``build`` runs its ``command`` from this checkout (``encdec``
  is ``python -m encdec.cli``, ``python`` is this interpreter) with exactly its
  ``environment`` (plus PATH/HOME/locale and the image's PYTHONUNBUFFERED);
* the ``redis`` image is replaced by a real local redis-server: one started here
  with the ``requirepass`` of the config file its command names (``redis-server
  /path/redis.conf ...``, the path under one of its mounts, read once its
  dependencies hold), else the ``redis_url`` fixture's;
* service hostnames become 127.0.0.1 and every exposed container port gets a
  free local port, and a path under a service's ``NAMED_VOLUME:/path`` mount
  becomes the same path under that volume's local directory (one per named
  volume, shared by every service that mounts it): see ``remap``, the one place
  values are rewritten;
* ``depends_on`` is honoured in order; ``service_healthy`` waits until the
  service's own ``healthcheck`` command, run locally with the service's
  environment, exits 0 (whatever it checks: the gRPC health service of the
  model services, ``GET /health`` of the HTTP gateway, which answers 200 only
  once its decoder and embed backends are SERVING); ``service_completed_successfully``
  waits until the one-shot service exited 0 (any other exit fails ``up``).

Docker-only isolation (networks, IPC/PID namespaces, shm size) has no local
effect; the tests check those keys structurally. ``compose_file.check_understood``
runs first and refuses any key or value form not translated here.

Example::

    project = load_project(Path("compose.yaml"))  # compose_file
    with LocalDeployment(project, redis_url, log_dir) as deployment:
        address = deployment.published(50051)   # "127.0.0.1:<port>"
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from helpers.compose_file import (
    DEFAULT_STOP_GRACE_PERIOD_S,
    Project,
    check_understood,
    exposed_ports,
    parse_duration,
    published_ports,
    require,
)

from encdec.launcher import stop_processes
from encdec.redis_server import LocalRedisServer, free_ports

LOOPBACK = {"127.0.0.1", "localhost", "0.0.0.0"}
PASSED_HOST_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL")
IMAGE_ENV = {"PYTHONUNBUFFERED": "1"}  # the Dockerfile's ENV (besides PATH)


# ---- the one rewrite -------------------------------------------------------------------------------
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)\b")


def remap(
    value: str,
    service: str,
    endpoints: dict[tuple[str, int], tuple[str, int]],
    key: str = "",
    mounts: dict[str, str] | None = None,
) -> str:
    """Rewrites one environment value or command argument from the compose network to this machine.

    Args:
        value: the value as the container would see it (already interpolated).
        service: the service it belongs to.
        endpoints: ``(service, container port) -> (host, port)`` on this machine; every exposed
            port of every service has one (free local ports; redis: the local redis-server).
        key: the environment variable's name, if it is one.
        mounts: this service's mounts, container path -> local directory of the named volume.

    Rules, applied to the whole value:
        * a container path at or under a mount's path: the same path under the volume's local directory.
        * ``HOST:PORT`` anywhere in it (alone, or inside ``redis://redis:6379/0``): a service
          name as HOST means that service's endpoint; 127.0.0.1 / localhost / 0.0.0.0 means this
          service's own. Other hosts are left alone.
        * the value of a ``*_PORT`` variable is one of this service's container ports: its local port.
        * ``0.0.0.0`` alone (listen on every interface) becomes ``127.0.0.1``.

    Raises:
        UnsupportedCompose: a ``HOST:PORT`` or ``*_PORT`` names a port its service does not expose
            (in Docker that connection would fail too).
    """
    for target, local in (mounts or {}).items():
        if value == target or value.startswith(target.rstrip("/") + "/"):
            return local + value[len(target.rstrip("/")) :]
    if key.endswith("_PORT"):
        require(
            value.isdigit() and (service, int(value)) in endpoints, f"{service}: {key}={value} is not an exposed port"
        )
        return str(endpoints[(service, int(value))][1])
    if value == "0.0.0.0":
        return "127.0.0.1"

    def sub(m: re.Match) -> str:
        host, port = m["host"], int(m["port"])
        owner = service if host in LOOPBACK else host
        if owner not in {s for s, _ in endpoints}:
            return m[0]
        require((owner, port) in endpoints, f"{service}: {m[0]} names a port {owner} does not expose")
        local_host, local_port = endpoints[(owner, port)]
        return f"{local_host}:{local_port}"

    return _HOST_PORT.sub(sub, value)


def redis_config(service: dict) -> str | None:
    """The config file a redis image's ``redis-server <file> ...`` command names, or None."""
    cmd = service.get("command") or []
    if "build" in service or len(cmd) < 2 or cmd[0] != "redis-server" or cmd[1].startswith("-"):
        return None
    return cmd[1]


def read_requirepass(path: Path) -> str:
    """The password of the ``requirepass "<password>"`` line of a redis.conf.

    Raises:
        UnsupportedCompose: the file has other lines, or none of that form.
    """
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    m = re.fullmatch(r'requirepass "([^"\\]+)"', lines[0]) if len(lines) == 1 else None
    require(m is not None, f'{path}: only a single requirepass "..." line is understood')
    return m[1]


def local_command(argv: list[str]) -> list[str]:
    """The image's executables as this checkout's: ``encdec`` and ``python``."""
    head = {"encdec": [sys.executable, "-m", "encdec.cli"], "python": [sys.executable]}.get(argv[0])
    require(head is not None, f"executable {argv[0]!r} has no local equivalent")
    return [*head, *argv[1:]]


# ---- running -----------------------------------------------------------------------------------------
@dataclass
class LocalDeployment:
    """The active services of ``project`` as local processes, started in ``depends_on`` order.

    Args:
        project: from ``load_project``.
        redis_url: a running redis-server standing in for the ``redis`` image.
        log_dir: each service's output goes to ``<log_dir>/<service>.log``.
        poll_s: how often an unhealthy service's healthcheck runs (compose waits ``interval``).
    """

    project: Project
    redis_url: str
    log_dir: Path
    poll_s: float = 1.0
    endpoints: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    volume_dirs: dict[str, Path] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)
    completed: set[str] = field(default_factory=set)
    redis_servers: dict[str, LocalRedisServer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_understood(self.project)
        url = urlsplit(self.redis_url)
        active = self.project.active()
        for name, svc in active.items():
            require("deploy" not in svc, f"{name} reserves devices; this machine has none")
        own = {name for name, svc in active.items() if "build" in svc or redis_config(svc)}  # ports picked here
        built = [(name, port) for name in own for port in exposed_ports(active[name])]
        local_ports = iter(free_ports(len(built)))  # distinct: separate picks could repeat a port
        for volume in self.project.volumes:  # a named volume: one local directory, empty at the first `up`
            self.volume_dirs[volume] = self.log_dir / "volumes" / volume
            self.volume_dirs[volume].mkdir(parents=True, exist_ok=True)
        for name, svc in active.items():
            for port in exposed_ports(svc):
                self.endpoints[(name, port)] = (
                    ("127.0.0.1", next(local_ports)) if name in own else (url.hostname, url.port)
                )

    def env(self, name: str) -> dict[str, str]:
        """The process environment of ``name``: its compose environment, remapped."""
        base = {k: os.environ[k] for k in PASSED_HOST_ENV if k in os.environ} | IMAGE_ENV
        svc_env = self.project.services[name].get("environment", {})
        mounts = self.mounts(name)
        return base | {k: remap(str(v), name, self.endpoints, k, mounts) for k, v in svc_env.items()}

    def mounts(self, name: str) -> dict[str, str]:
        """``name``'s ``NAMED_VOLUME:/path`` mounts: container path -> the volume's local directory."""
        pairs = (str(m).partition(":")[::2] for m in self.project.services[name].get("volumes", []))
        return {target: str(self.volume_dirs[volume]) for volume, target in pairs}

    def published(self, host_port: int) -> str:
        """``host:port`` on this machine of whatever compose publishes on ``host_port``."""
        for name, svc in self.project.active().items():
            for host, container in published_ports(svc):
                if host == host_port:
                    host, port = self.endpoints[(name, container)]
                    return f"{host}:{port}"
        raise KeyError(f"nothing publishes port {host_port}")

    def service_address(self, name: str) -> str:
        host, port = self.endpoints[(name, exposed_ports(self.project.services[name])[0])]
        return f"{host}:{port}"

    def healthcheck(self, name: str) -> subprocess.Popen:
        """Starts ``name``'s healthcheck command locally with the service's environment."""
        test = self.project.services[name]["healthcheck"]["test"][1:]
        argv = local_command([remap(a, name, self.endpoints) for a in test])
        return subprocess.Popen(argv, env=self.env(name), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _ready(self, dep: str, condition: str) -> bool:
        if condition == "service_completed_successfully":
            return dep in self.completed
        return dep in self.healthy if condition == "service_healthy" else dep in self.procs or dep in self.healthy

    def _one_shot(self, name: str) -> bool:
        """Whether a service depends on ``name`` having completed (it is expected to exit 0)."""
        return any(
            spec["condition"] == "service_completed_successfully"
            for svc in self.project.active().values()
            for dep, spec in svc.get("depends_on", {}).items()
            if dep == name
        )

    def _start(self, name: str, svc: dict) -> None:
        if "build" not in svc:  # the redis image: a local redis-server
            conf = redis_config(svc)
            if conf is not None:
                path = remap(conf, name, self.endpoints, mounts=self.mounts(name))
                server = LocalRedisServer(
                    port=self.endpoints[(name, exposed_ports(svc)[0])][1],
                    password=read_requirepass(Path(path)),
                    extra_args=tuple(svc["command"][2:]),
                )
                self.redis_servers[name] = server.start()
            self.healthy.add(name)
            return
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            local_command(svc["command"]),
            env=self.env(name),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if "healthcheck" not in svc and not self._one_shot(name):
            self.healthy.add(name)

    def _listening(self, name: str) -> bool:
        """Whether any exposed port of ``name`` accepts a TCP connection."""
        for port in exposed_ports(self.project.services[name]):
            try:
                socket.create_connection(self.endpoints[(name, port)], timeout=0.5).close()
                return True
            except OSError:
                pass
        return False

    def _log_tail(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def up(self) -> LocalDeployment:
        """Starts every active service once its dependencies' conditions hold; returns when all are
        healthy.

        Raises:
            RuntimeError: a service exited; or was not healthy within ``start_period + interval *
                retries`` (compose would mark it unhealthy and fail its dependents); or a
                ``depends_on`` can never hold.
        """
        services = self.project.active()
        deadlines: dict[str, float] = {}
        last_error: dict[str, str] = {}
        try:
            while len(self.healthy) < len(services):
                for name, svc in services.items():
                    if name not in deadlines and all(
                        self._ready(d, c["condition"]) for d, c in svc.get("depends_on", {}).items()
                    ):
                        self._start(name, svc)
                        hc = svc.get("healthcheck", {})
                        deadlines[name] = (
                            time.monotonic()
                            + parse_duration(hc.get("start_period", "0s"))
                            + parse_duration(hc.get("interval", "30s")) * hc.get("retries", 3)
                        )
                waiting = [n for n in deadlines if n not in self.healthy]
                if not waiting and len(self.healthy) < len(services):
                    raise RuntimeError(f"depends_on never holds for {sorted(set(services) - set(deadlines))}")
                for name, proc in self.procs.items():
                    if proc.poll() is None or name in self.completed:
                        continue
                    if proc.returncode == 0 and self._one_shot(name):
                        self.completed.add(name)
                        self.healthy.add(name)
                        continue
                    raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{self._log_tail(name)}")
                for name in waiting:
                    if time.monotonic() > deadlines[name]:
                        raise RuntimeError(
                            f"{name} unhealthy ({last_error.get(name, 'port never opened')}):\n{self._log_tail(name)}"
                        )
                # The command proper (a Python process) only once a port is open: it cannot pass before,
                # and spawning it every poll would steal the CPU the services load their models with.
                checks = {n: self.healthcheck(n) for n in waiting if self._listening(n)}
                for name, check in checks.items():
                    try:
                        _, err = check.communicate(
                            timeout=parse_duration(services[name]["healthcheck"].get("timeout", "30s")) + 10
                        )
                    except subprocess.TimeoutExpired:
                        check.kill()
                        _, err = check.communicate()
                    if check.returncode == 0:
                        self.healthy.add(name)
                    else:
                        last_error[name] = err.decode(errors="replace").strip()[-500:]
                if len(self.healthy) < len(services):
                    time.sleep(self.poll_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """As ``docker compose down``: each service in turn, last started first (dependents before what they
        depend on), gets SIGTERM, then SIGKILL once its ``stop_grace_period`` (compose's default 10 s) passes."""
        for name, proc in reversed(list(self.procs.items())):
            grace = self.project.services[name].get("stop_grace_period")
            stop_processes([proc], parse_duration(grace) if grace else DEFAULT_STOP_GRACE_PERIOD_S)
        self.procs.clear()
        for server in self.redis_servers.values():
            server.stop()
        self.redis_servers.clear()

    def __enter__(self) -> LocalDeployment:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
