"""``EmbedService`` (Embed, Rerank, Classify, Tokenize) for encoder-only models.

Thin: validate and convert the request, tokenize off the event loop, submit to
the ``EmbedBatcher``, convert back. Errors raised here become status codes in
``shared.grpc_server.ErrorStatusInterceptor``. A call cancelled while it waits on
the batcher (client gone, deadline passed) cancels its batcher job, so the model
stops spending forwards on it; the batcher also knows the call's deadline and
drops the job unrun once it passes. A call whose deadline has passed before its
tokenization gets DEADLINE_EXCEEDED without any work. Every text goes through the
character bound of ``encoder_svc.embed.tokenizing`` before its tokenizer; a
Tokenize response holds at most ``max_inputs x max_input_length`` tokens. Embed
takes texts (``inputs``) or token id lists (``input_ids``, ``EmbedEngine.encode_ids``).
Loading and serving: ``encoder_svc.embed.startup``.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc

from encoder_svc.embed.batcher import DeadlineExceededError, EmbedBatcher
from encoder_svc.embed.engine import EmbedEngine, finish_embedding, label_scores
from shared.errors import InvalidRequestError, NotFoundError, ResourceExhaustedError, ServiceError, status_for
from shared.proto import embed_pb2, embed_pb2_grpc

_POOLING = {embed_pb2.POOLING_CLS: "cls", embed_pb2.POOLING_MEAN: "mean", embed_pb2.POOLING_LAST: "last"}


class UnsupportedByModelError(ServiceError):
    """The served model cannot do this (no classification head, several labels for Rerank)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def _observed(method):
    """Records the call's RPC name, final status code and time in ``self.metrics`` (when set)."""
    rpc = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        start = time.perf_counter()
        code = "OK"
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:
            # gRPC cancels the handler when the client's deadline passes as well as when the client goes away.
            remaining = context.time_remaining()
            code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            raise
        except Exception as exc:
            code = status_for(exc)[0].name
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_request(rpc, code, time.perf_counter() - start)

    return wrapper


def _deadline(context) -> float | None:
    """The call's deadline as ``time.monotonic()``, or None (no deadline, or no gRPC context).

    Raises:
        DeadlineExceededError: it has passed already.
    """
    remaining = context.time_remaining() if context is not None else None
    if remaining is None:
        return None
    if remaining <= 0:
        raise DeadlineExceededError("the call's deadline passed before its work could start; nothing was computed")
    return time.monotonic() + remaining


class EmbedServicer(embed_pb2_grpc.EmbedServiceServicer):
    """Serves one encoder-only model.

    Args:
        engine: the loaded model.
        batcher: runs forwards over batches of requests.
        model_name: the name responses carry (the ``--model`` given).
        served_names: names a request's ``model`` field may use.
        max_inputs: most inputs (or documents) per request.
        metrics: ``shared.metrics.EmbedMetrics`` recording each call, or None.
    """

    def __init__(
        self,
        engine: EmbedEngine,
        batcher: EmbedBatcher,
        model_name: str,
        served_names: frozenset[str],
        max_inputs: int,
        metrics=None,
    ) -> None:
        self.engine = engine
        self.batcher = batcher
        self.model_name = model_name
        self.served_names = served_names
        self.max_inputs = max_inputs
        self.metrics = metrics

    def _check(self, model: str, count: int, what: str = "inputs", allow_empty: bool = False) -> None:
        if model and model not in self.served_names:
            shown = model if len(model) <= 256 else model[:256] + "..."  # a status message travels in 16 KiB metadata
            raise NotFoundError(f"model {shown!r} is not served here; this encoder serves {self.model_name!r}")
        if count == 0 and not allow_empty:
            raise InvalidRequestError(f"{what} is empty; send at least one")
        if count > self.max_inputs:
            raise ResourceExhaustedError(
                f"{count} {what} is more than this server's limit of {self.max_inputs} per request "
                "(--max-inputs-per-request); split the list"
            )

    def _head(self, rerank: bool) -> None:
        if not self.engine.num_labels:
            raise UnsupportedByModelError(
                f"model {self.model_name!r} has no sequence-classification head; it serves Embed and Tokenize"
            )
        if rerank and self.engine.num_labels != 1:
            raise UnsupportedByModelError(
                f"Rerank needs a single-score cross-encoder; model {self.model_name!r} has {self.engine.num_labels} labels: use Classify"
            )

    async def _off_loop(self, context, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the default executor, unless the call's deadline has passed already."""
        _deadline(context)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def _tokenize(self, context, *args, **kwargs):
        return await self._off_loop(context, self.engine.tokenize, *args, **kwargs)

    async def _batch(self, seqs, pooling: str, context=None):
        """Runs ``seqs`` through the batcher with the call's deadline; if this call is cancelled
        or ends meanwhile, cancels the job so that its forwards not yet run are dropped.

        Raises:
            DeadlineExceededError: the deadline passed before (or while) its sequences waited.
        """
        future = self.batcher.submit(seqs, pooling, _deadline(context))
        if context is not None:
            context.add_done_callback(lambda _: future.cancel())  # the client went away or the deadline passed
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    @_observed
    async def Embed(self, request, context):
        if request.inputs and request.input_ids:
            raise InvalidRequestError(
                "this request sets both inputs and input_ids; set only one: texts in inputs, or token id "
                "lists in input_ids"
            )
        by_ids = len(request.input_ids) > 0
        if by_ids:
            self._check(request.model, len(request.input_ids), "input_ids")
        else:
            self._check(request.model, len(request.inputs))
        if request.dimensions > self.engine.hidden_size:
            raise InvalidRequestError(
                f"dimensions {request.dimensions} is more than the model's {self.engine.hidden_size}"
            )
        if request.pooling != embed_pb2.POOLING_UNSPECIFIED and request.pooling not in _POOLING:
            raise InvalidRequestError(
                f"pooling {request.pooling} is not a known Pooling value; use POOLING_CLS, "
                "POOLING_MEAN, POOLING_LAST or leave it unset for the model's default"
            )
        pooling = _POOLING.get(request.pooling, self.engine.spec.pooling)
        normalize = request.normalize if request.HasField("normalize") else self.engine.spec.normalize
        if by_ids:  # the same sequences as texts give, so the forward, pooling and batching are shared
            ids = [t.ids for t in request.input_ids]
            seqs = await self._off_loop(context, self.engine.encode_ids, ids, truncate=request.truncate)
        else:
            seqs = await self._tokenize(context, list(request.inputs), truncate=request.truncate)
        outs = await self._batch(seqs, pooling, context)
        embeddings = [
            embed_pb2.Embedding(
                values=finish_embedding(v, normalize, request.dimensions).tolist(), num_tokens=len(s.ids)
            )
            for v, s in zip(outs, seqs)
        ]
        return embed_pb2.EmbedResponse(model=self.model_name, embeddings=embeddings, usage=_usage(seqs))

    @_observed
    async def Rerank(self, request, context):
        self._check(request.model, len(request.documents), "documents")
        self._head(rerank=True)
        docs = list(request.documents)
        seqs = await self._tokenize(
            context, [request.query] * len(docs), docs, truncate=request.truncate, names=("the query", "document {i}")
        )
        outs = await self._batch(seqs, "logits", context)
        scores = [float(label_scores(o, True, request.raw_scores)[0]) for o in outs]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        results = [embed_pb2.RerankResult(index=i, score=scores[i]) for i in order]
        return embed_pb2.RerankResponse(model=self.model_name, results=results, usage=_usage(seqs))

    @_observed
    async def Classify(self, request, context):
        self._check(request.model, len(request.inputs))
        self._head(rerank=False)
        texts = [i.text for i in request.inputs]
        pairs = [i.text_pair if i.HasField("text_pair") else None for i in request.inputs]
        seqs = await self._tokenize(context, texts, pairs, truncate=request.truncate)
        outs = await self._batch(seqs, "logits", context)
        labels = self.engine.labels
        results = []
        for o in outs:
            scores = label_scores(o, self.engine.multi_label, request.raw_scores).tolist()
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            results.append(
                embed_pb2.Classification(
                    scores=[embed_pb2.LabelScore(label_id=i, label=labels[i], score=scores[i]) for i in order]
                )
            )
        return embed_pb2.ClassifyResponse(model=self.model_name, results=results, usage=_usage(seqs))

    @_observed
    async def Tokenize(self, request, context):
        self._check(request.model, len(request.inputs), allow_empty=True)
        texts = [i.text for i in request.inputs]
        pairs = [i.text_pair if i.HasField("text_pair") else None for i in request.inputs]
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        seqs = await self._tokenize(
            context,
            texts,
            pairs,
            truncate=request.truncate,
            add_special_tokens=special,
            check_length=False,
            offsets=True,
            max_total_tokens=self.max_inputs * self.engine.max_input_length,
        )
        tok = self.engine.tokenizer
        out = []
        for s in seqs:
            offs = s.offsets or []
            out.append(
                embed_pb2.TokenizedInput(
                    ids=s.ids,
                    token_type_ids=s.type_ids or [0] * len(s.ids),
                    tokens=tok.convert_ids_to_tokens(s.ids),
                    starts=[a for a, _ in offs],
                    ends=[b for _, b in offs],
                )
            )
        return embed_pb2.TokenizeResponse(
            model=self.model_name, tokens=out, max_input_length=self.engine.max_input_length
        )


def _usage(seqs) -> embed_pb2.EmbedUsage:
    return embed_pb2.EmbedUsage(prompt_tokens=sum(len(s.ids) for s in seqs))
