"""``gateway_process``: an HTTP gateway (``encdec serve-http``) process of a test's own, in front of any backends,
healthy or not (``encdec.launcher.http_gateway`` waits for a healthy one and hides its process)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from encdec.launcher import stop_processes
from encdec.redis_server import free_port


@contextlib.contextmanager
def gateway_process(
    decoder_addresses: list[str],
    embed_addresses: list[str] = (),
    extra_args: list[str] = (),
    log: Path | None = None,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
):
    """Starts the gateway on a free port; yields ``(url, proc)`` once ``/health`` answers at all (200 or 503).

    ``extra_args``: more ``serve-http`` flags; ``log``: a file for its output (default: ours).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "encdec.cli", "--log-level", "WARNING", "serve-http", "--port", str(port)]
    cmd += ["--decoder-address", ",".join(decoder_addresses)]
    cmd += ["--embed-address", ",".join(embed_addresses)] if embed_addresses else []
    cmd += list(extra_args)
    with open(log, "ab") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            cmd, start_new_session=True, stdout=out, stderr=subprocess.STDOUT if out else None, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
            try:
                httpx.get(f"{url}/health", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway did not answer"
                time.sleep(0.2)
        yield url, proc
    finally:
        stop_processes([proc])
