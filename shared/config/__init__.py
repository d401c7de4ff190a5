"""Typed configuration of both services: one source of defaults.

``ServiceConfig`` (``base``) holds the fields every service has;
``EncoderServiceConfig`` (``encoder``) and ``DecoderServiceConfig`` (``decoder``)
inherit it. Every field maps onto a CLI flag (``--max-num-seqs``) and an
environment variable (``ENCDEC_MAX_NUM_SEQS``) (``flags``); the flag wins over
the variable, the variable over the default here.
"""

from __future__ import annotations

from shared.config.base import (
    DEFAULT_DECODER_ADDRESS,
    DEFAULT_ENCODER_ADDRESS,
    DEFAULT_MODEL,
    KV_DIST_BACKENDS,
    KV_DTYPES,
    KV_TRANSPORTS,
    ServiceConfig,
)
from shared.config.decoder import DecoderServiceConfig
from shared.config.encoder import CPU_MAX_BATCH_TOKENS, CUDA_MAX_BATCH_TOKENS, EncoderServiceConfig
from shared.config.flags import add_config_arguments, config_from
from shared.config.memory_size import parse_memory_size

__all__ = [
    "CPU_MAX_BATCH_TOKENS",
    "CUDA_MAX_BATCH_TOKENS",
    "DEFAULT_MODEL",
    "DEFAULT_ENCODER_ADDRESS",
    "DEFAULT_DECODER_ADDRESS",
    "KV_DIST_BACKENDS",
    "KV_DTYPES",
    "KV_TRANSPORTS",
    "ServiceConfig",
    "EncoderServiceConfig",
    "DecoderServiceConfig",
    "add_config_arguments",
    "config_from",
    "parse_memory_size",
]
