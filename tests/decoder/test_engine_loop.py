"""EngineLoop's decode hold on a real DecoderEngine (tiny random T5): while a request waits for its
cross KV, model steps wait (up to ``max_decode_hold_s``) and new requests still go to the encoder.

The test plays the encoder: it writes a request's cross KV (the model's own ``compute_cross_kv``) at the
blocks the loop handed out, then marks it encoded through the loop, as decoder_svc.server does.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.text_paged import encode_batch

from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.engine_loop import HOLD_GAP_STEPS, EngineLoop
from decoder_svc.core.sampling_params import SamplingParams
from shared.kv_transport import write_blocks
from shared.models.registry import load_model, load_tokenizer

BLOCK = 4
SOURCES = {"a": [5, 6, 7, 8, 9, 1], "b": [10, 11, 12, 1], "c": [13, 14, 1]}
NEW = 6


@pytest.fixture(scope="module")
def t5(text_checkpoints):
    path = text_checkpoints["t5"]
    model = load_model(str(path))
    kv = dict(zip(SOURCES, encode_batch(model, list(SOURCES.values()))))
    return model, load_tokenizer(str(path)), kv


class RecordingLoop(EngineLoop):
    """An EngineLoop that also records each step's output request ids, as the event loop receives them."""

    steps: list[list[str]]

    def _deliver(self, to_encode, outputs) -> None:
        if outputs:
            self.steps.append([o.request_id for o in outputs])
        super()._deliver(to_encode, outputs)


class Harness:
    """A RecordingLoop on a tiny T5 engine: ``steps`` holds each step's output request ids."""

    def __init__(self, t5, max_decode_hold_s: float, hold_gap_steps: int = HOLD_GAP_STEPS) -> None:
        model, tokenizer, self.kv = t5
        c = model.config
        self.cross = torch.zeros(c.decoder_layers, 2, 16, BLOCK, c.num_heads, c.head_dim)
        self.engine = DecoderEngine(model, tokenizer, self.cross, num_self_blocks=16, block_size=BLOCK, max_num_seqs=4)
        self.blocks: dict[str, list[int]] = {}
        self.steps: list[list[str]] = []
        self.finished: set[str] = set()
        self.errors: list[BaseException] = []
        self.loop = RecordingLoop(
            self.engine,
            asyncio.get_running_loop(),
            self._on_encode,
            self._on_output,
            self.errors.append,
            num_threads=1,
            max_decode_hold_s=max_decode_hold_s,
            hold_gap_steps=hold_gap_steps,
        )
        self.loop.steps = self.steps  # before any request exists, so before any step

    def _on_encode(self, request_id: str, block_ids: list[int]) -> None:
        self.blocks[request_id] = block_ids

    def _on_output(self, output) -> None:
        if output.finished:
            self.finished.add(output.request_id)

    async def add(self, rid: str) -> None:
        params = SamplingParams(max_tokens=NEW, min_tokens=NEW, ignore_eos=True)
        await self.loop.call(self.engine.add_request, rid, len(SOURCES[rid]), params)
        await self.until(lambda: rid in self.blocks)

    async def encode(self, rid: str) -> None:
        write_blocks(self.cross, self.blocks[rid], self.kv[rid])
        assert await self.loop.call(self.engine.mark_encoded, rid)

    async def until(self, cond, timeout_s: float = 30.0) -> None:
        for _ in range(int(timeout_s / 0.01)):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not met in time")


def run(coro):
    return asyncio.run(coro)


def test_hold_pauses_running_sequences_until_a_burst_is_encoded(t5):
    """Running sequences wait for the requests still encoding; each request's first step (its TTFT) runs at once."""

    async def main():
        h = Harness(t5, max_decode_hold_s=60.0)
        try:
            await h.add("a")
            await h.add("b")  # handed to the encoder although "a" holds the loop (dispatch_encodes)
            await h.encode("a")
            await h.until(lambda: len(h.steps) == 1)  # "a"'s first token is not held ...
            await asyncio.sleep(0.3)
            assert h.steps == [["a"]]  # ... its next ones are, while "b" encodes
            await h.add("c")  # a new request still reaches the encoder during the hold
            await h.encode("b")
            await h.until(lambda: len(h.steps) == 2)
            await asyncio.sleep(0.3)
            assert [sorted(s) for s in h.steps] == [["a"], ["a", "b"]]  # "b" started, then the hold went on for "c"
            await h.encode("c")
            await h.until(lambda: h.finished == {"a", "b", "c"})
            assert all(sorted(s) == ["a", "b", "c"] for s in h.steps[2:NEW])  # the rest decoded together
            assert len(h.steps) == NEW + 2 and not h.errors
        finally:
            h.loop.stop()

    run(main())


def test_hold_is_bounded_by_max_decode_hold(t5):
    async def main():
        h = Harness(t5, max_decode_hold_s=0.05)
        try:
            await h.add("a")
            await h.add("b")
            await h.encode("a")  # "b" is never encoded: "a" must still finish, one step per expired hold
            await h.until(lambda: "a" in h.finished)
            assert all(s == ["a"] for s in h.steps) and len(h.steps) == NEW
            assert h.engine.num_encoding == 1 and not h.errors
            assert await h.loop.call(h.engine.abort, "b")
            assert h.engine.num_encoding == 0 and not h.engine.has_unfinished_requests()
        finally:
            h.loop.stop()

    run(main())


def test_no_hold_decodes_while_others_encode(t5):
    async def main():
        h = Harness(t5, max_decode_hold_s=0.0)
        try:
            await h.add("a")
            await h.add("b")
            await h.encode("a")
            await h.until(lambda: "a" in h.finished)  # decoded alone while "b" encodes
            assert all(s == ["a"] for s in h.steps)
            await h.encode("b")
            await h.until(lambda: "b" in h.finished)
            assert not h.errors
        finally:
            h.loop.stop()

    run(main())


def test_a_hold_that_ran_out_does_not_come_back_for_the_same_encode(t5):
    """An Encode that never lands (hung encoder, up to encode_timeout_s) pauses the others once, not every step."""

    async def main():
        h = Harness(t5, max_decode_hold_s=1.0)
        try:
            await h.add("a")
            await h.add("b")  # never encoded
            await h.encode("a")
            start = asyncio.get_running_loop().time()
            await h.until(lambda: "a" in h.finished)
            # One hold (<= 1 s) then NEW free steps; a hold per step would take NEW s.
            assert asyncio.get_running_loop().time() - start < 1.0 + (NEW - 1) / 2
            assert len(h.steps) == NEW and not h.errors
            assert await h.loop.call(h.engine.abort, "b")
        finally:
            h.loop.stop()

    run(main())


def test_the_hold_clock_starts_when_a_sequence_could_step(t5):
    """A wait while every request still encodes pauses no one: it does not use up the hold."""

    async def main():
        h = Harness(t5, max_decode_hold_s=1.0)
        try:
            await h.add("a")
            await h.add("b")
            await asyncio.sleep(1.3)  # longer than the hold, with nothing ready to step
            await h.encode("a")  # the clock starts here (and "a"'s first step runs) ...
            await asyncio.sleep(0.3)
            assert h.steps == [["a"]]  # ... so "a" still waits for "b"
            await h.encode("b")
            await h.until(lambda: h.finished == {"a", "b"})
            assert all(sorted(s) == ["a", "b"] for s in h.steps[1:NEW]) and len(h.steps) == NEW + 1 and not h.errors
        finally:
            h.loop.stop()

    run(main())


def test_a_hold_that_ran_out_while_the_encoder_delivered_comes_back_after_the_gap(t5):
    """The encoder works through a burst (an arrival during the hold): after hold_gap_steps model
    steps, the requests still encoding hold the running ones again."""

    async def main():
        h = Harness(t5, max_decode_hold_s=1.0, hold_gap_steps=2)
        try:
            for rid in ("a", "b", "c"):
                await h.add(rid)
            await h.encode("a")  # the clock starts; "a"'s first step runs
            await asyncio.sleep(0.2)
            await h.encode("b")  # an arrival during the hold (its first step runs); "c" still encodes when it runs out
            await h.until(lambda: len(h.steps) >= 4)
            await asyncio.sleep(0.3)
            # the two first steps, the gap's two steps, then a new hold
            assert [sorted(s) for s in h.steps] == [["a"], ["a", "b"], ["a", "b"], ["a", "b"]]
            await h.encode("c")  # its first step ends that hold's pause: all three step together
            await h.until(lambda: h.finished == {"a", "b", "c"})
            assert sorted(h.steps[4]) == ["a", "b", "c"] and len(h.steps) == NEW + 4 and not h.errors
        finally:
            h.loop.stop()

    run(main())


def test_a_released_request_holds_no_one(t5):
    """A request cancelled while its Encode is in flight (the server keeps its blocks until the encoder answers,
    ``release_hold``) stops pausing the running ones at once, not when the hold runs out."""

    async def main():
        h = Harness(t5, max_decode_hold_s=60.0)
        try:
            await h.add("a")
            await h.add("b")  # its Encode never answers here
            await h.encode("a")
            await asyncio.sleep(0.3)
            assert h.steps == [["a"]]  # held for "b"
            await h.loop.call(h.loop.release_hold, "b")
            await h.until(lambda: "a" in h.finished, timeout_s=10.0)
            assert all(s == ["a"] for s in h.steps) and len(h.steps) == NEW and not h.errors
            assert await h.loop.call(h.engine.abort, "b")
        finally:
            h.loop.stop()

    run(main())
