"""A request's release survives a second cancellation (issue 34: the critical KV-block leak of a break test).

The break test saw it once in ten tries: with the encoder stopped, a request ended by its deadline and then by its
stream closing (a cancellation, then another while the first one's cleanup waited for the Encode) kept one engine
sequence and its cross blocks for good. Here the same order of events is made deterministic on a real engine,
real Redis and the real ``Sessions`` / ``RequestSession``: the encoder is played by an Encode that does not answer
until the test lets it (a stopped encoder), the call's task is cancelled once (its cleanup then waits for that
Encode, whose blocks the encoder may still write), and again while it waits. Every block must come back, the
sequence leave the engine, the session its table, and the record end ABORTED. With the release unshielded (before
7a1aa6d) the twice-cancelled case fails: the session never leaves the table and its blocks stay held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.replicas.request_state import RequestState, RequestStateStore
from decoder_svc.session.encode_client import EncodeClient
from decoder_svc.session.inputs import parse_input
from decoder_svc.session.sessions import Sessions
from decoder_svc.startup import build_engine
from shared.config.decoder import DecoderServiceConfig
from shared.metrics import DecoderMetrics
from shared.models.registry import load_model
from shared.proto import decoder_pb2


async def until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("cancels", [1, 2])
def test_a_release_cancelled_again_while_it_waits_for_the_encode_still_frees_everything(
    text_checkpoints, redis_url, redis_key_prefix, cancels
):
    config = DecoderServiceConfig(
        model=str(text_checkpoints["t5"]),
        redis_url=redis_url,
        encoder_address="127.0.0.1:9",  # never called: the test plays the encoder
        block_size=8,
        max_num_seqs=2,
    )
    model = load_model(config.model)
    engine, pool = build_engine(config, model)
    store = RequestStateStore(redis_url, key_prefix=redis_key_prefix)
    metrics = DecoderMetrics()

    async def scenario() -> None:
        sessions = Sessions(config, engine, store, EncodeClient(config, pool, metrics), metrics)
        sessions.start(1)
        encoder_answers = asyncio.Event()
        encodes: list[list[int]] = []
        try:
            free_before = engine.stats()
            request = decoder_pb2.GenerateRequest(input_ids=decoder_pb2.TokenIds(ids=[5, 6, 7, 8, 9, 1]))
            inp = parse_input(request, model, engine.tokenizer, config.max_audio_s)
            await sessions.create_record("r1")
            session = sessions.open("r1", inp, SamplingParams(max_tokens=8), 0, time.monotonic())

            async def stopped_encoder(block_ids: list[int]) -> None:  # RequestSession._encode, encoder stopped
                encodes.append(block_ids)
                await encoder_answers.wait()

            session._encode = stopped_encoder

            async def call() -> None:  # decoder_svc.server's Generate: the stream, closed with the call
                async with contextlib.aclosing(session.run()) as messages:
                    async for _ in messages:
                        pass

            task = asyncio.create_task(call())
            await until(lambda: encodes and session.encoding is not None, "the engine reserved its cross blocks")
            held = engine.stats()
            assert held["num_free_cross_blocks"] < free_before["num_free_cross_blocks"]
            task.cancel()  # the deadline: its cleanup waits for the Encode that may still write those blocks
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert not task.done() and "r1" in sessions.active  # waiting for the Encode
            if cancels == 2:
                task.cancel()  # the stream closing, while the cleanup waits
                for _ in range(5):
                    await asyncio.sleep(0.01)
            encoder_answers.set()  # the encoder answers (or its call fails): the blocks are the decoder's again
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            await until(lambda: "r1" not in sessions.active, "the session left the table")
            await until(lambda: engine.stats()["num_running"] + engine.stats()["num_waiting"] == 0, "engine empty")
            after = engine.stats()
            assert after["num_free_cross_blocks"] == free_before["num_free_cross_blocks"], after
            assert after["num_free_self_blocks"] == free_before["num_free_self_blocks"], after
            record = await asyncio.to_thread(store.get, "r1")
            assert record.state == RequestState.ABORTED, record
            assert "r1" not in sessions.open_records
        finally:
            encoder_answers.set()
            await sessions.close()

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
        store.close()
