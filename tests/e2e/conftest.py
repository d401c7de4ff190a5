"""Fixtures the Whisper end-to-end modules share, started once a session.

One tiny.en and one whisper-base stack (``test_e2e_whisper_options.stack``: Redis + encoder + decoder, no
Prometheus ports) serve ``test_e2e_whisper_longform.py`` and ``test_e2e_whisper_options.py``; a test that
kills a process restarts it before it ends. ``base_case`` runs each of ``BASE_CASES`` alone once on the base
stack, so the options checks and the everything-at-once check judge the same results.
"""

from __future__ import annotations

import functools

import grpc
import pytest

from shared.proto import decoder_pb2_grpc

TINY_ENCODE_TIMEOUT_S = 10  # tiny.en's stack: a window whose encoder is gone fails within this


@pytest.fixture(scope="session")
def tiny_services(redis_url, tmp_path_factory):
    from test_e2e_whisper_options import TINY, stack

    decoder_args = ("--encode-timeout-s", str(TINY_ENCODE_TIMEOUT_S))
    with stack(TINY, redis_url, tmp_path_factory.mktemp("tiny-logs"), decoder_args) as svc:
        yield svc


@pytest.fixture(scope="session")
def tiny_stub(tiny_services):
    with grpc.insecure_channel(tiny_services.decoder_address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


@pytest.fixture(scope="session")
def base_stub(redis_url, tmp_path_factory):
    from test_e2e_whisper_options import BASE, stack

    with stack(BASE, redis_url, tmp_path_factory.mktemp("base-logs")) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield decoder_pb2_grpc.DecoderServiceStub(channel)


@pytest.fixture(scope="session")
def base_case(base_stub):
    """``name -> Result``: ``BASE_CASES[name]`` sent alone on the base stack, once a session."""
    from test_e2e_whisper_options import run_case

    return functools.cache(lambda name: run_case(base_stub, name))
