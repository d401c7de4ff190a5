"""The local redis-server of ``encdec up`` and the tests requires a password (issue 23): a local user who
does not hold it can neither read nor forge request records, and it never shows on a command line or in
``encdec up``'s output (real redis-server, real ``encdec up`` processes)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
import redis
from test_cli_up import CLIP, _up

from encdec.redis_server import LocalRedisServer
from shared.proto import decoder_pb2, decoder_pb2_grpc


def _cmdlines() -> list[str]:
    """Every process's command line (NULs as spaces), as any local user reads it in ``ps``."""
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(path.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # exited meanwhile
            continue
    return out


def _descendant_cmdlines(root: int) -> list[str]:
    """The command lines of ``root``'s descendants (other processes on the machine are not this test's)."""
    parents: dict[int, int] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue
        parents[int(path.parent.name)] = int(fields[1])
    out = []
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, root):
            ancestor = parents.get(ancestor)
        if ancestor == root:
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return out


def test_local_redis_server_requires_its_generated_password_on_loopback_only():
    with LocalRedisServer() as server:
        assert len(server.password) == 32 and server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
        anonymous = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("encdec:request:forged", "FINISHED")
        anonymous.close()
        client = redis.Redis.from_url(server.url)
        assert client.ping() and client.config_get("bind")["bind"] == "127.0.0.1"
        client.close()
        assert not any(server.password in line for line in _cmdlines())  # handed over on stdin
        first = server.password
        server.stop()
        server.start()  # a restart (the peer-fault tests restart Redis) keeps the password
        assert server.password == first
        assert redis.Redis.from_url(server.url).ping()
    with LocalRedisServer(password='with "quotes" \\ and space') as server:
        assert redis.Redis.from_url(server.url).ping()
    with LocalRedisServer(password="") as server:  # explicitly none
        assert server.url.startswith("redis://127.0.0.1:") and redis.Redis.from_url(server.url).ping()


def test_encdec_up_runs_its_redis_with_a_password_it_never_prints_or_puts_on_a_command_line():
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # `up` starts its own redis-server
    proc = _up("--decoder-args=--metrics-port 0", "--encoder-args=--metrics-port 0", env=env)
    try:
        ready = next((line for line in proc.stdout if line.startswith("ready:")), None)
        assert ready, "encdec up did not become ready"
        shown = re.search(r"redis at (\S+/0)\.", ready)[1]  # "redis://:***@127.0.0.1:PORT/0"
        assert urlsplit(shown).password == "***", ready
        port = urlsplit(shown).port
        with pytest.raises(redis.AuthenticationError):  # a local user without the password
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).get("x")
        assert any(f"127.0.0.1:{port}" in line for line in _cmdlines())  # found the redis-server
        decoders = [line for line in _descendant_cmdlines(proc.pid) if "serve-decoder" in line]
        assert decoders and not any("redis://" in line for line in decoders), decoders
        address = ready.split(" at ")[1].split(",")[0]
        with grpc.insecure_channel(address) as channel:  # the decoder holds the password: requests work
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request = decoder_pb2.GenerateRequest(
                audio=CLIP.read_bytes(), sampling=decoder_pb2.SamplingParams(max_tokens=5)
            )
            messages = list(stub.Generate(request, timeout=120))
            record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=messages[0].request_id), timeout=30)
        assert record.state == decoder_pb2.REQUEST_STATE_FINISHED
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0
