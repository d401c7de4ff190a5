"""``--model-aliases``: OpenAI's model names (``whisper-1``, ``text-embedding-3-small``) reach the served models,
through the official ``openai`` client, with the same results as the served names; a malformed alias fails the start.
"""

from __future__ import annotations

import subprocess

import numpy as np
import openai
import pytest
from helpers.cli import encdec

from encdec import DATA_DIR
from encdec.launcher import http_gateway

ALIASES = "whisper-1=whisper-tiny.en, text-embedding-3-small=all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def aliased(stack):
    with http_gateway(stack.decoder_addresses, stack.embed_addresses, ["--model-aliases", ALIASES]) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_aliases_serve_as_their_models(aliased):
    clip = DATA_DIR / "short.wav"
    with open(clip, "rb") as f:
        by_alias = aliased.audio.transcriptions.create(model="whisper-1", file=f).text
    with open(clip, "rb") as f:
        by_name = aliased.audio.transcriptions.create(model="whisper-tiny.en", file=f).text
    assert by_alias == by_name and by_alias
    texts = ["a sentence", "another one"]
    alias_vectors = aliased.embeddings.create(model="text-embedding-3-small", input=texts).data
    name_vectors = aliased.embeddings.create(model="all-MiniLM-L6-v2", input=texts).data
    for a, n in zip(alias_vectors, name_vectors):
        assert np.array_equal(np.float32(a.embedding), np.float32(n.embedding))
    ids = [m.id for m in aliased.models.list().data]
    assert {"whisper-1", "text-embedding-3-small", "whisper-tiny.en", "all-MiniLM-L6-v2"} <= set(ids), ids
    assert aliased.models.retrieve("whisper-1").id == "whisper-1"
    with pytest.raises(openai.NotFoundError):
        aliased.embeddings.create(model="text-embedding-3-large", input="x")


def test_a_malformed_alias_fails_the_start():
    proc = subprocess.run(
        encdec("serve-http", "--port", "0", "--decoder-address", "127.0.0.1:1", "--model-aliases", "whisper-1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "alias=model" in proc.stderr, proc.stderr[-2000:]
