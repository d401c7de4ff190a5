"""The services behind the HTTP gateway tests, started once for tests/gateway/ (real processes, real Redis).

- a Whisper tiny.en encoder + decoder (``/v1/audio/*``),
- a tiny random T5 encoder + decoder (``/v1/completions``),
- an embed service of all-MiniLM-L6-v2 (``/v1/embeddings``) and one of a random one-label BERT cross-encoder
  (``/v1/rerank``),
- the gateway (``encdec serve-http``) in front of all four, without an API key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.embed_checkpoints import build_classifier

from encdec.launcher import Services, encoder_service, http_gateway

EMBED_MODEL = "all-MiniLM-L6-v2"


@dataclass
class Stack:
    url: str  # the gateway's base URL; the OpenAI API is under /v1
    whisper: Services
    t5: Services
    t5_path: Path
    embed_address: str
    rerank_address: str
    rerank_path: Path

    @property
    def decoder_addresses(self) -> list[str]:
        return [self.whisper.decoder_address, self.t5.decoder_address]

    @property
    def embed_addresses(self) -> list[str]:
        return [self.embed_address, self.rerank_address]


@pytest.fixture(scope="session")
def stack(redis_url, text_checkpoints, tmp_path_factory, tiny_services):
    logs = tmp_path_factory.mktemp("gateway-logs")
    rerank_path = build_classifier(tmp_path_factory.mktemp("reranker") / "bert-rerank", "bert", num_labels=1)
    t5_path = text_checkpoints["t5"]
    whisper = tiny_services  # the session's tiny.en stack (tests/conftest.py)
    t5 = Services(model=str(t5_path), redis_url=redis_url, log_dir=str(logs / "t5"), log_level="WARNING")
    with t5, encoder_service(EMBED_MODEL) as embed, encoder_service(str(rerank_path)) as rerank:
        with http_gateway([whisper.decoder_address, t5.decoder_address], [embed, rerank]) as url:
            yield Stack(url, whisper, t5, t5_path, embed, rerank, rerank_path)
