"""The readiness watcher's log: a start that is not ready yet (a decoder up before its encoder) is INFO, a start
that stays not ready past its grace and any later loss of readiness are WARNINGs (a new user read the old
start-up WARNING as a failure)."""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from shared.grpc_server import _watch_readiness


def _run(reasons: list[str | None], grace_s: float, caplog) -> list[tuple[int, str]]:
    """Runs the watcher over ``reasons`` (one per probe, None = ready); returns its (level, message) records."""
    servicer = health.aio.HealthServicer()
    probes = iter(reasons)
    done = asyncio.Event()

    async def readiness():
        try:
            return next(probes)
        except StopIteration:
            done.set()
            await asyncio.sleep(3600)

    async def main():
        task = asyncio.create_task(_watch_readiness(servicer, ["svc"], readiness, 0.0, startup_grace_s=grace_s))
        await done.wait()
        task.cancel()
        status = (await servicer.Check(health_pb2.HealthCheckRequest(service="svc"), None)).status
        return status

    with caplog.at_level(logging.INFO, logger="shared.grpc_server"):
        status = asyncio.run(main())
    assert status == (
        health_pb2.HealthCheckResponse.SERVING if reasons[-1] is None else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shared.grpc_server"]


def test_a_start_before_the_encoder_logs_info_then_ready(caplog):
    records = _run(["encoder unreachable", "encoder unreachable", None], grace_s=60, caplog=caplog)
    assert [level for level, _ in records] == [logging.INFO, logging.INFO]
    assert records[0][1].startswith("not ready yet") and records[1][1] == "ready: health SERVING"


def test_a_start_that_stays_not_ready_past_its_grace_warns_once(caplog):
    records = _run(["encoder unreachable"] * 4, grace_s=0.0, caplog=caplog)
    assert [level for level, _ in records] == [logging.WARNING]
    assert "encoder unreachable" in records[0][1]


def test_losing_readiness_warns_at_once_and_again_after_recovery(caplog):
    records = _run([None, "redis down", "redis down", None, "encoder lost"], grace_s=60, caplog=caplog)
    assert [level for level, _ in records] == [
        logging.INFO,
        logging.WARNING,
        logging.INFO,
        logging.WARNING,
    ], records
