"""``POST /v1/completions`` for the text models: each prompt is one Generate call (its ``n`` samples inside it).

Choices are numbered as vLLM numbers them: prompt ``i``'s sample ``j`` is choice ``i * n + j``. With
``stream``, server-sent ``text_completion`` chunks as the decoder streams, then (``stream_options.include_usage``)
a chunk with ``usage`` and no choices, then ``data: [DONE]``. The decoder's first message is awaited before the
HTTP answer starts, so a request the decoder refuses gets its HTTP status (400, 404, 429, 503) even when streamed;
an error after that ends the stream with a ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
from fastapi import APIRouter, Depends, Request

from gateway_svc.backends import Backend, Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import bad_request, building_request, from_rpc_error
from gateway_svc.route_support import (
    backends,
    config,
    error_event,
    json_response,
    new_id,
    sse,
    stream_messages,
    unless_disconnected,
)
from gateway_svc.schemas import CompletionRequest, as_items
from shared.proto import decoder_pb2

router = APIRouter()

FINISH_REASONS = {
    decoder_pb2.FINISH_REASON_STOP: "stop",
    decoder_pb2.FINISH_REASON_LENGTH: "length",
    decoder_pb2.FINISH_REASON_ABORT: "abort",
}
MAX_PROMPTS = 256  # prompts in one request (each is a Generate call)


def sampling_params(body: CompletionRequest) -> decoder_pb2.SamplingParams:
    """The Generate sampling of ``body`` (the decoder validates the values' ranges itself).

    Raises:
        GatewayError: 400 for a field an encoder-decoder cannot honour at a value other than its neutral one.
    """
    for name, neutral in (("echo", False), ("suffix", None), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if getattr(body, name) != neutral:
            raise bad_request(f"{name} is not supported by this server (leave it at {neutral!r})", name)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of other than n is not supported; use n, or num_beams via gRPC", "best_of")
    params = decoder_pb2.SamplingParams(n=body.n)
    for name in ("temperature", "top_p", "seed", "max_tokens", "min_p", "repetition_penalty", "min_tokens"):
        if (value := getattr(body, name)) is not None:
            setattr(params, name, value)
    for name in ("ignore_eos", "include_stop_str_in_output", "no_repeat_ngram_size"):
        if (value := getattr(body, name)) is not None:
            setattr(params, name, value)
    if body.top_k is not None:
        params.top_k = max(body.top_k, 0)  # vLLM's -1 = off is our 0
    if body.stop:
        params.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        params.stop_token_ids.extend(body.stop_token_ids)
    if body.logprobs is not None:
        params.logprobs = True
        params.top_logprobs = body.logprobs
    return params


def generate_requests(body: CompletionRequest, model: str) -> list[decoder_pb2.GenerateRequest]:
    """One GenerateRequest per prompt (a string, a list of strings, a token-id list or a list of them).

    Raises:
        GatewayError: 400, no prompt, more than ``MAX_PROMPTS``, or a field out of range.
    """
    prompts = as_items(body.prompt)
    if not prompts:
        raise bad_request("prompt is empty; send a string, a list of strings or token-id lists", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"{len(prompts)} prompts; the limit is {MAX_PROMPTS} per request", "prompt")
    with building_request():  # the strings may be the prompt's or the stop strings
        return _generate_requests(body, prompts, model)


def _generate_requests(body: CompletionRequest, prompts: list, model: str) -> list[decoder_pb2.GenerateRequest]:
    params = sampling_params(body)
    out = []
    for prompt in prompts:
        request = decoder_pb2.GenerateRequest(
            model=model, sampling=params, priority=body.priority, truncate=body.truncate
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.input_ids.ids.extend(prompt)
        out.append(request)
    return out


@dataclass
class Choice:
    """One sample's completion, gathered from its stream messages."""

    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, message: decoder_pb2.GenerateResponse, with_logprobs: bool) -> dict | None:
        """Adds ``message``; returns its logprobs object (OpenAI's, for this message's tokens) when asked for.

        OpenAI's ``tokens`` join to the text and ``text_offset`` is each token's start in it. The decoder's token
        texts are context-free (``Logprobs.token``: a SentencePiece word-start token keeps its leading space,
        vLLM's convention) while the text drops the space of its first word, so at the text's start that one
        space is dropped from the token (and its alternatives).
        """
        at_start = not self.text and not self.tokens
        offset = len(self.text)
        self.text += message.text
        if message.finish_reason:
            self.finish_reason = FINISH_REASONS.get(message.finish_reason)
        if not with_logprobs:
            return None
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in message.logprobs:
            trim = at_start and lp.token.startswith(" ") and not message.text.startswith(" ")
            at_start = False
            token = lp.token[1:] if trim else lp.token
            part["tokens"].append(token)
            part["token_logprobs"].append(lp.logprob)
            part["top_logprobs"].append(
                {(t.token[1:] if trim and t.token.startswith(" ") else t.token): t.logprob for t in lp.top}
            )
            part["text_offset"].append(offset)
            offset += len(token)
        self.tokens += part["tokens"]
        self.token_logprobs += part["token_logprobs"]
        self.top_logprobs += part["top_logprobs"]
        self.text_offset += part["text_offset"]
        return part

    def logprobs(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _usage(finals: list[decoder_pb2.GenerateResponse]) -> dict:
    prompt = sum(m.usage.encoder_tokens for m in finals)
    completion = sum(m.usage.completion_tokens for m in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _start(backend: Backend, requests, timeout_s: float):
    """Starts every Generate call and reads its first message (so refusals become HTTP statuses).

    Returns:
        ``[(call, its first message, or grpc.aio.EOF for a stream that ended at once)]``.

    Raises:
        grpc.RpcError: a call failed before its first message (every call is cancelled then).
    """
    calls = [backend.decoder.Generate(r, timeout=timeout_s) for r in requests]
    try:
        firsts = await asyncio.gather(*(call.read() for call in calls))
    except BaseException:
        for call in calls:
            call.cancel()
        raise
    return list(zip(calls, firsts))


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, b: Backends = Depends(backends), cfg: GatewayConfig = Depends(config)
):
    requests = generate_requests(body, b.wire_name(body.model))
    backend = await b.lookup(body.model, ("text",), "/v1/completions")
    meta = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": backend.model}
    started = await unless_disconnected(request, _start(backend, requests, cfg.request_timeout_s))
    with_logprobs = body.logprobs is not None
    if body.stream:
        return sse(_stream(started, body, meta, with_logprobs))
    return json_response(await unless_disconnected(request, _gather(started, body.n, meta, with_logprobs)))


async def _gather(started, n: int, meta: dict, with_logprobs: bool) -> dict:
    choices = [Choice() for _ in range(len(started) * n)]
    finals = []
    try:
        for p, (call, first) in enumerate(started):
            async for message in stream_messages(call, first):
                choices[p * n + message.index].add(message, with_logprobs)
                if message.HasField("usage"):
                    finals.append(message)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        for call, _ in started:
            call.cancel()
    return {
        **meta,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": c.logprobs() if with_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(finals),
    }


async def _stream(started, body: CompletionRequest, meta: dict, with_logprobs: bool):
    """The SSE events of a streamed completion: the prompts' streams merged as their messages arrive."""
    n = body.n
    queue: asyncio.Queue = asyncio.Queue()
    choices = [Choice() for _ in range(len(started) * n)]
    finals: list[decoder_pb2.GenerateResponse] = []

    async def pump(p: int, call, first) -> None:
        try:
            async for message in stream_messages(call, first):
                await queue.put((p, message))
        except grpc.RpcError as exc:
            await queue.put((p, exc))
        finally:
            await queue.put((p, None))

    tasks = [asyncio.create_task(pump(p, call, first)) for p, (call, first) in enumerate(started)]
    try:
        open_streams = len(tasks)
        while open_streams:
            p, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, grpc.RpcError):
                yield error_event(item)
                return
            index = p * n + item.index
            part = choices[index].add(item, with_logprobs)
            if item.HasField("usage"):
                finals.append(item)
            if item.text or item.finish_reason:
                finish = FINISH_REASONS.get(item.finish_reason) if item.finish_reason else None
                yield {
                    **meta,
                    "choices": [{"index": index, "text": item.text, "logprobs": part, "finish_reason": finish}],
                }
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {**meta, "choices": [], "usage": _usage(finals)}
        yield "[DONE]"
    finally:
        for task in tasks:
            task.cancel()
        for call, _ in started:
            call.cancel()
