"""``POST /v1/embeddings`` and ``POST /v1/rerank`` over the embed service's Embed and Rerank RPCs.

Vectors are the Embed RPC's float32 values exactly: ``float`` writes each as the shortest decimal that reads back
to the same float32 (``route_support.json_response``); ``base64`` is the little-endian float32 bytes, as OpenAI sends them (and
as the ``openai`` Python client asks for by default).
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Depends, Request, Response

from gateway_svc.backends import Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import bad_request, building_request
from gateway_svc.route_support import backends, body_schema, config, json_body, json_response, new_id
from gateway_svc.schemas import EmbeddingsRequest, RerankRequest, as_items
from shared.proto import embed_pb2

router = APIRouter()


def embed_request(body: EmbeddingsRequest, model: str, max_inputs: int) -> embed_pb2.EmbedRequest:
    """The Embed RPC for ``body``.

    Raises:
        GatewayError: 400, an empty input list or more than ``max_inputs`` items.
    """
    inputs = as_items(body.input)
    if not inputs:
        raise bad_request("input is empty; send a string, a list of strings or a list of token-id lists", "input")
    if len(inputs) > max_inputs:
        raise bad_request(
            f"input has {len(inputs)} items; the limit is {max_inputs} per request (--max-embedding-inputs): "
            "split the list",
            "input",
        )
    with building_request("input"):
        request = embed_pb2.EmbedRequest(model=model, dimensions=body.dimensions or 0, truncate=body.truncate)
        if body.normalize is not None:
            request.normalize = body.normalize
        if isinstance(inputs[0], str):
            request.inputs.extend(inputs)
        else:
            request.input_ids.extend(embed_pb2.EmbedTokenIds(ids=ids) for ids in inputs)
    return request


@router.post("/v1/embeddings", openapi_extra=body_schema(EmbeddingsRequest))
async def embeddings(http: Request) -> Response:
    body = await json_body(http, EmbeddingsRequest)
    b, cfg = http.app.state.backends, http.app.state.config  # no Depends on the hottest route: see json_body
    request = embed_request(body, b.wire_name(body.model), cfg.max_embedding_inputs)
    backend = await b.lookup(body.model, ("embed",), "/v1/embeddings")
    response = await backend.embed.Embed(request, timeout=cfg.request_timeout_s)
    if body.encoding_format == "base64":
        vectors = [base64.b64encode(np.asarray(e.values, dtype="<f4").tobytes()).decode() for e in response.embeddings]
    else:
        vectors = [np.asarray(e.values, dtype=np.float32) for e in response.embeddings]
    tokens = response.usage.prompt_tokens
    return json_response(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": response.model or backend.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(
    body: RerankRequest, b: Backends = Depends(backends), cfg: GatewayConfig = Depends(config)
) -> Response:
    """Scores each document against the query (a cross-encoder with one label: sigmoid of its logit), best first."""
    backend = await b.lookup(body.model, ("embed",), "/v1/rerank")
    with building_request():
        request = embed_pb2.RerankRequest(
            model=b.wire_name(body.model),
            query=body.query,
            documents=body.documents,
            truncate=body.truncate,
            top_n=body.top_n or 0,
        )
    response = await backend.embed.Rerank(request, timeout=cfg.request_timeout_s)
    results = []
    for r in response.results:
        result = {"index": r.index, "relevance_score": r.score}
        if body.return_documents:
            result["document"] = {"text": body.documents[r.index]}
        results.append(result)
    return json_response(
        {
            "id": new_id("rerank"),
            "model": response.model or backend.model,
            "usage": {"total_tokens": response.usage.prompt_tokens},
            "results": results,
        }
    )
