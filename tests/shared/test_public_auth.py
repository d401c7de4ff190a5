"""The bearer token and the per-client limit of a public gRPC port (``shared.public_auth``,
``shared.client_limits``), on a real server process (``helpers.plumbing_server``: ``shared.grpc_server.serve``
with a small DecoderService of the test's own) reached over loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.plumbing_server import plumbing_server

from shared.client_limits import peer_ip
from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.public_auth import MISSING_TOKEN, load_bearer_token
from shared.tls import ClientSecurity

TOKEN = "s3cret-token-for-the-tests-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A plaintext public port needing ``TOKEN``, at most 1 call in flight per client; yields (address, log path,
    server process)."""
    root = tmp_path_factory.mktemp("public-auth")
    (root / "token").write_text(f"  {TOKEN}\n")  # surrounding whitespace is stripped
    log = root / "server.log"
    fields = {"auth_token_file": str(root / "token"), "max_requests_per_client": 1}
    with plumbing_server(fields, log) as (address, proc):
        yield address, log, proc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def _call(address: str, token: str = "", method: str = "GetStats", max_tokens: int = 1):
    """One RPC through ``ClientSecurity(token)``'s channel: GetStats's reply, or Generate's messages."""
    async with ClientSecurity(token=token).channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        if method == "GetStats":
            return await stub.GetStats(decoder_pb2.GetStatsRequest(), timeout=10)
        request = decoder_pb2.GenerateRequest(text="hi", sampling=decoder_pb2.SamplingParams(max_tokens=max_tokens))
        return [m async for m in stub.Generate(request, timeout=10)]


def test_right_token_passes_on_unary_and_stream(server):
    address = server[0]
    assert run(_call(address, TOKEN)).model == "plumbing"
    assert [m.text for m in run(_call(address, TOKEN, "Generate", 3))] == ["hi"] * 3


@pytest.mark.parametrize("method", ["GetStats", "Generate"])
def test_missing_token_is_unauthenticated(server, method):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(_call(server[0], "", method))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == MISSING_TOKEN and "--token" in MISSING_TOKEN and "ENCDEC_TOKEN" in MISSING_TOKEN


@pytest.mark.parametrize("token", ["wrong-token-of-the-same-kind-0123456789", TOKEN[:-1], TOKEN + "x"])
def test_wrong_token_is_unauthenticated(server, token):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(_call(server[0], token, "Generate"))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.value.details() == "invalid bearer token"


def test_other_schemes_and_raw_metadata(server):
    """The scheme is case-insensitive; a Basic header or a bare token is no bearer token."""

    async def with_metadata(value: str):
        async with grpc.aio.insecure_channel(server[0]) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            return await stub.GetStats(decoder_pb2.GetStatsRequest(), metadata=[("authorization", value)], timeout=10)

    assert run(with_metadata(f"bearer {TOKEN}")).model == "plumbing"
    for value in (f"Basic {TOKEN}", TOKEN):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            run(with_metadata(value))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _memory_mib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of process ``pid``, MiB (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith(f"{field}:"))


def test_an_unauthenticated_body_is_never_received(server):
    """Issue 34 item 4: 8 Generates of 48 MiB without the token at once are refused UNAUTHENTICATED before gRPC
    reads their bodies; the server's peak memory stays where it was (the unary refusal read and parsed every
    body: 39 -> 584 MiB peak for 8 x 50 MiB, 489 MiB still held after)."""
    address, _, proc = server
    peak_before = _memory_mib(proc.pid, "VmHWM")
    body = decoder_pb2.GenerateRequest(text="x" * (48 << 20))

    async def flood():
        options = [("grpc.max_send_message_length", 1 << 30)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)

            async def one():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [m async for m in stub.Generate(body, timeout=20)]
                return err.value.code(), err.value.details()

            return await asyncio.gather(*[one() for _ in range(8)])

    assert set(run(flood())) == {(grpc.StatusCode.UNAUTHENTICATED, MISSING_TOKEN)}
    # gRPC may take in what flow control lets through before the refusal (a few MiB a call, more on a loaded
    # machine): far from the bodies themselves (384 MiB; the old refusal peaked ~590 MiB above).
    assert _memory_mib(proc.pid, "VmHWM") - peak_before < 160
    assert run(_call(address, TOKEN)).model == "plumbing"  # the port serves on


def test_calls_past_max_concurrent_rpcs_are_refused_before_their_body(tmp_path):
    """``--max-concurrent-rpcs`` bounds the calls a port runs at once, with and without the token: a call past
    it gets RESOURCE_EXHAUSTED at once; the slot comes back when a call ends."""
    (tmp_path / "token").write_text(TOKEN)
    fields = {"auth_token_file": str(tmp_path / "token"), "max_concurrent_rpcs": 2, "max_requests_per_client": 0}

    async def scenario(address):
        async with ClientSecurity(token=TOKEN).channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            slow = decoder_pb2.GenerateRequest(text="a", sampling=decoder_pb2.SamplingParams(max_tokens=30))
            running = [stub.Generate(slow, timeout=10) for _ in range(2)]
            for call in running:
                assert (await call.read()).text == "a"  # both run now
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [m async for m in stub.Generate(decoder_pb2.GenerateRequest(text="b"), timeout=10)]
            for call in running:
                call.cancel()
            for _ in range(50):  # the server sees the cancellations shortly after
                try:
                    return err.value, [m.text async for m in stub.Generate(decoder_pb2.GenerateRequest(text="c"))]
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            raise AssertionError("the cancelled calls' slots never came back")

    with plumbing_server(fields, tmp_path / "server.log") as (address, _):
        refused, after = run(scenario(address))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after == ["c"]


def test_health_needs_no_token(server):
    with grpc.insecure_channel(server[0]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_token_never_logged(server):
    run(_call(server[0], TOKEN))
    with pytest.raises(grpc.aio.AioRpcError):
        run(_call(server[0], "wrong-token-of-the-same-kind-0123456789"))
    text = server[1].read_text()
    assert "bearer token required" in text and "at most 1 calls in flight per client" in text
    assert TOKEN not in text and "wrong-token" not in text


def test_second_call_of_a_client_is_refused_while_one_runs(server):
    """limit 1: a call while a stream runs gets RESOURCE_EXHAUSTED naming the flag; health and the control calls
    (GetStats here; Abort, GetRequest) are not counted; the slot comes back when the stream ends, and when a
    stream is cancelled."""
    address = server[0]

    async def scenario():
        async with ClientSecurity(token=TOKEN).channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            long = stub.Generate(
                decoder_pb2.GenerateRequest(text="a", sampling=decoder_pb2.SamplingParams(max_tokens=20)), timeout=10
            )
            first = await long.read()  # the stream runs now
            assert first.text == "a"
            assert (await stub.GetStats(decoder_pb2.GetStatsRequest(), timeout=10)).model == "plumbing"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [m async for m in stub.Generate(decoder_pb2.GenerateRequest(text="b"), timeout=10)]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-requests-per-client" in err.value.details() and "127.0.0.1" in err.value.details()
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            rest = [m async for m in long]
            assert len(rest) == 19
            one = [m async for m in stub.Generate(decoder_pb2.GenerateRequest(text="d"), timeout=10)]
            assert [m.text for m in one] == ["d"]
            cancelled = stub.Generate(
                decoder_pb2.GenerateRequest(text="c", sampling=decoder_pb2.SamplingParams(max_tokens=50)), timeout=10
            )
            await cancelled.read()
            cancelled.cancel()
            for _ in range(50):  # the server sees the cancellation shortly after
                try:
                    return [m async for m in stub.Generate(decoder_pb2.GenerateRequest(text="e"), timeout=10)]
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.05)
            raise AssertionError("the cancelled stream's slot was never released")

    assert [m.text for m in run(scenario())] == ["e"]


def test_control_calls_have_a_bucket_of_their_own(server):
    """Issue 34 item 7: control calls are counted too, apart from model calls: with a limit of 1, a second poll
    while one runs is refused naming the control calls, while a Generate still runs beside it; Abort-like calls
    of a client at its model limit go through (the stream runs while the poll is refused)."""

    async def scenario():
        async with ClientSecurity(token=TOKEN).channel(server[0]) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            slow_poll = asyncio.ensure_future(
                stub.GetRequest(decoder_pb2.GetRequestRequest(request_id="sleep:1.5"), timeout=10)
            )
            await asyncio.sleep(0.3)  # the slow poll holds the control slot
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetRequest(decoder_pb2.GetRequestRequest(request_id="other"), timeout=10)
            streamed = [m.text async for m in stub.Generate(decoder_pb2.GenerateRequest(text="g"), timeout=10)]
            with pytest.raises(grpc.aio.AioRpcError) as polled:
                await slow_poll
            return err.value, streamed, polled.value

    refused, streamed, polled = run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "control calls" in refused.details() and "--max-requests-per-client" in refused.details()
    assert streamed == ["g"] and polled.code() == grpc.StatusCode.NOT_FOUND


def test_concurrent_calls_one_refused(server):
    async def scenario():
        calls = [_call(server[0], TOKEN, "Generate", 10) for _ in range(2)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = run(scenario())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 1 and refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [len(r) for r in results if isinstance(r, list)] == [10]


@pytest.mark.parametrize(
    "peer, ip",
    [("ipv4:1.2.3.4:5678", "1.2.3.4"), ("ipv6:[::1]:5678", "::1"), ("ipv6:[fe80::1%eth0]:1", "fe80::1%eth0")]
    + [("unix:/tmp/sock", "unix:/tmp/sock"), ("", "")],
)
def test_peer_ip(peer, ip):
    assert peer_ip(peer) == ip


def test_load_bearer_token(tmp_path):
    assert load_bearer_token() is None
    (tmp_path / "t").write_text(TOKEN + "\n")
    assert load_bearer_token(str(tmp_path / "t")) == TOKEN
    assert load_bearer_token(auth_token=TOKEN) == TOKEN
    cases = {
        "are both set": dict(auth_token_file=str(tmp_path / "t"), auth_token=TOKEN),
        "cannot be read": dict(auth_token_file=str(tmp_path / "missing")),
        "is empty": dict(auth_token_file=str((tmp_path / "e").resolve())),
        "at least 16": dict(auth_token="short"),
        "without spaces": dict(auth_token="a token with spaces in it"),
        "at most 4096": dict(auth_token_file=str(tmp_path / "long")),  # read whole, not cut to a valid prefix
        "non-ASCII": dict(auth_token_file=str(tmp_path / "latin")),
    }
    (tmp_path / "e").write_text("  \n")
    (tmp_path / "long").write_text("x" * 266_000)
    (tmp_path / "latin").write_bytes("é".encode("latin-1") * 20)
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            load_bearer_token(**kwargs)


def test_bad_token_file_fails_the_start(tmp_path):
    """A service whose token file is missing exits at start-up with the reason, before serving."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "encdec.cli", "serve-decoder", "--auth-token-file", str(tmp_path / "nope")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 2, done.stderr
    assert "auth_token_file" in done.stderr and "cannot be read" in done.stderr


def test_health_watch_streams_are_bounded_per_client(server):
    """Issue 34 break test: health needs no token and a Watch never ends, so 20 Watch streams from one address held
    every slot of a port whose --max-concurrent-rpcs was 20. At most 4 per client address now (Check is open)."""
    from shared.client_limits import MAX_WATCHES_PER_CLIENT

    async def scenario():
        async with grpc.aio.insecure_channel(server[0]) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(MAX_WATCHES_PER_CLIENT)]
            for w in watches:
                assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
            extra = health.Watch(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await extra.read()
            check = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # never limited
            watches[0].cancel()
            for _ in range(50):  # the server sees the cancellation shortly after
                again = health.Watch(health_pb2.HealthCheckRequest())
                try:
                    first = await again.read()
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("the cancelled Watch's slot never came back")
            for w in [*watches[1:], again]:
                w.cancel()
            return err.value, check, first

    refused, check, first = run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Watch" in refused.details()
    assert check.status == first.status == health_pb2.HealthCheckResponse.SERVING
