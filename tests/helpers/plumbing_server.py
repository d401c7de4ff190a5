"""A process serving ``shared.grpc_server.serve`` with a small DecoderService of the tests' own, for the tests of
the public port's plumbing (bearer token, TLS, per-client limit) without a model.

``python -m helpers.plumbing_server PORT '{"auth_token_file": ..., ...}'`` serves until SIGTERM; the JSON holds
``DecoderServiceConfig`` fields, and ``"input_kind": "audio"`` for a speech model. Its servicer: ``GetStats``
answers ``model="plumbing"`` (a text model, or a speech one); ``GetRequest`` of id ``sleep:S`` answers NOT_FOUND
after ``S`` seconds (a slow control call); ``Generate`` streams ``sampling.max_tokens`` messages (default 1) 50 ms
apart, each with the request's ``text``, except that a ``text`` of ``fail:<CODE>:<details>`` ends the call at once
with that gRPC status and details (what a failing backend tells the HTTP gateway). An audio request
(``/v1/audio/*``) whose Whisper ``prompt`` is ``S`` or ``S:N`` waits S seconds, then streams N messages (default 1)
50 ms apart, each with the audio's length (``"<bytes> bytes"``).
``plumbing_server(config)`` starts one on a free port and yields its address once health answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


class PlumbingServicer:
    """The test's DecoderService: enough RPCs to see the interceptors at work (built inside the server process)."""

    input_kind = "text"

    async def GetStats(self, request, context):
        from shared.proto import decoder_pb2

        return decoder_pb2.DecoderStats(model="plumbing", input_kind=self.input_kind)

    async def GetRequest(self, request, context):
        """A control call that takes ``S`` seconds for a request id ``sleep:S``, then knows no such request."""
        import grpc

        if request.request_id.startswith("sleep:"):
            await asyncio.sleep(float(request.request_id.removeprefix("sleep:")))
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r}")

    async def Generate(self, request, context):
        import grpc

        from shared.proto import decoder_pb2

        if request.audio:
            logging.getLogger("plumbing").info("audio of %d bytes", len(request.audio))  # tests wait for the line
            wait_s, _, count = request.whisper.prompt.partition(":")
            await asyncio.sleep(float(wait_s or 0))
            for _ in range(int(count or 1)):
                yield decoder_pb2.GenerateResponse(request_id="plumbing", text=f"{len(request.audio)} bytes")
                await asyncio.sleep(0.05)
            return
        if request.text.startswith("fail:"):
            _, code, details = request.text.split(":", 2)
            await context.abort(grpc.StatusCode[code], details)
        for _ in range(request.sampling.max_tokens or 1):
            await asyncio.sleep(0.05)
            yield decoder_pb2.GenerateResponse(request_id="plumbing", text=request.text)


def main(port: int, fields: dict) -> None:
    from shared.config import DecoderServiceConfig
    from shared.grpc_server import serve
    from shared.proto import decoder_pb2_grpc

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    kind = fields.pop("input_kind", "text")
    config = DecoderServiceConfig(port=port, metrics_port=0, **fields)
    servicer = type("Servicer", (PlumbingServicer, decoder_pb2_grpc.DecoderServiceServicer), {"input_kind": kind})()
    asyncio.run(
        serve(
            lambda server: decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server),
            ["encdec.v1.DecoderService"],
            f"127.0.0.1:{port}",
            config=config,
        )
    )


@contextlib.contextmanager
def plumbing_server(fields: dict, log_path: Path, credentials=None, timeout_s: float = 60.0):
    """Starts the server with ``DecoderServiceConfig`` ``fields`` on a free port, its log in ``log_path``; yields
    ``(address, proc)``. ``credentials``: the health wait's TLS credentials (a TLS server)."""
    from encdec.launcher import stop_processes, wait_healthy
    from encdec.redis_server import free_port

    port = free_port()
    root = str(TESTS.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(TESTS), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "helpers.plumbing_server", str(port), json.dumps(fields)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
            start_new_session=True,
        )
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout_s, proc, credentials)
        yield f"127.0.0.1:{port}", proc
    finally:
        stop_processes([proc])


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
