"""Request bodies of the JSON routes (pydantic), as OpenAI's API reference defines them, with vLLM's names for
our extensions. Unknown fields are refused (400 naming the field), never ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_MODEL_NAME_LEN = 512  # characters; a backend's error message repeats the name (gRPC caps metadata at 16 KiB)
INT32_MAX = 2**31 - 1

# The proto's integer widths, so that a value the gateway accepts always fits the gRPC message.
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME_LEN)]


def as_items(value: str | list) -> list:
    """OpenAI's "one or many" field (``input``, ``prompt``) as a list of items: a string or one token-id list is
    one item; a list of strings or of token-id lists is already one."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return value


class Strict(BaseModel):
    """Unknown fields refused; no coercion ("3" is not an int, "yes" not a bool); NaN and infinities refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class EmbeddingsRequest(Strict):
    """``POST /v1/embeddings``: ``input`` is a string, a list of strings, one token-id list or a list of them."""

    model: ModelName
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, gt=0, le=INT32_MAX)
    user: str | None = None
    # Extensions (TEI's names): cut over-long inputs instead of refusing them; L2-normalise (model default).
    truncate: bool = False
    normalize: bool | None = None


class RerankRequest(Strict):
    """``POST /v1/rerank`` (the Jina / Cohere / vLLM shape)."""

    model: ModelName
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0, le=INT32_MAX)
    return_documents: bool = True
    truncate: bool = False


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(Strict):
    """``POST /v1/completions`` for the text models (T5, BART, mBART, Marian): the prompt is the encoder's source.

    OpenAI's defaults: ``max_tokens`` 16, ``temperature`` 1, ``top_p`` 1, ``n`` 1. Fields OpenAI defines that an
    encoder-decoder cannot honour (``echo``, ``suffix``, penalties, ``logit_bias``, ``best_of`` other than ``n``)
    are accepted at their neutral value only.
    """

    model: ModelName
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # the decoder's bound (proto SamplingParams.seed)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=INT32_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extensions.
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    no_repeat_ngram_size: int | None = Field(default=None, ge=0, le=INT32_MAX)
    priority: Int32 = 0
    truncate: bool = False
