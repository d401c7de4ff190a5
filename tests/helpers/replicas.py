"""Many encoder and decoder replicas on one Redis, each a real ``encdec serve-*`` process (the scale-out tests).

Unlike ``encdec.launcher.Services`` (one encoder + one decoder wired to each
other), decoders here find their encoders through the Redis registry
(``--encoder-address registry``), each replica has a name, its own ports and
log file, and any of them can be killed (SIGKILL: a crash) or started late.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import redis

from encdec.launcher import stop_processes, wait_healthy
from encdec.redis_server import free_ports


@dataclass
class Replica:
    name: str
    role: str  # "encoder" | "decoder"
    proc: subprocess.Popen
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Replicas:
    """Starts named replicas against ``redis_url``; ``stop()`` (or the context's exit) ends the ones still running.

    Args:
        redis_url: the shared Redis (request state and the registry).
        log_dir: one ``<name>.log`` per replica.
        internal_token_file: the deployment's Encode token (``--internal-token-file`` on every replica).
        lease_ttl_s: ``--lease-ttl-s`` of every replica.
        startup_timeout_s: how long a replica may take to report SERVING.
    """

    redis_url: str
    log_dir: str
    internal_token_file: str
    lease_ttl_s: float = 2.0
    startup_timeout_s: float = 180.0
    replicas: dict[str, Replica] = field(default_factory=dict)

    def _spawn(self, name: str, role: str, args: list[str]) -> Replica:
        port, metrics_port = free_ports(2)
        common = [
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--redis-url",
            self.redis_url,
            "--lease-ttl-s",
            str(self.lease_ttl_s),
            "--internal-token-file",
            self.internal_token_file,
        ]
        cmd = [sys.executable, "-m", "encdec.cli", "--log-level", "INFO", f"serve-{role}", *common, *args]
        os.makedirs(self.log_dir, exist_ok=True)
        out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        replica = Replica(name, role, proc, port, metrics_port)
        self.replicas[name] = replica
        return replica

    def start(self, specs: list[tuple[str, str, list[str]]]) -> list[Replica]:
        """Starts ``(name, role, extra args)`` replicas at once and waits until every one reports SERVING."""
        started = [self._spawn(name, role, args) for name, role, args in specs]
        for replica in started:
            wait_healthy(replica.address, self.startup_timeout_s, replica.proc)
        return started

    def encoder(self, name: str, model: str, *args: str) -> tuple[str, str, list[str]]:
        return name, "encoder", ["--model", model, *args]

    def decoder(self, name: str, model: str, *args: str) -> tuple[str, str, list[str]]:
        return name, "decoder", ["--model", model, "--encoder-address", "registry", *args]

    def __getitem__(self, name: str) -> Replica:
        return self.replicas[name]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` (default SIGKILL) and waits for the process to exit."""
        proc = self.replicas[name].proc
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(timeout=30)

    def log(self, name: str) -> str:
        with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        stop_processes([r.proc for r in self.replicas.values() if r.proc.poll() is None])

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def registered_id(url: str, address: str) -> str:
    """The id under which the replica serving ``address`` registered in the Redis at ``url`` (``shared.registry``).

    Raises:
        AssertionError: no replica is registered at ``address``.
    """
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        for key in client.scan_iter(match="encdec:replica:*"):
            info = json.loads(client.get(key) or "{}")
            if info.get("address") == address:
                return info["replica_id"]
    finally:
        client.close()
    raise AssertionError(f"no replica registered at {address}")
