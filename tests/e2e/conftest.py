"""Fixtures the Whisper end-to-end modules share, started once a session.

One whisper-base stack (``helpers.stacks.stack``: Redis + encoder + decoder, no Prometheus ports) serves
``test_e2e_whisper_longform.py`` and ``test_e2e_whisper_options.py``, beside the session's tiny.en stack
(``tiny_services`` in tests/conftest.py); a test that kills a process restarts it before it ends. ``base_case`` runs each of ``BASE_CASES`` alone once on the base
stack, so the options checks and the everything-at-once check judge the same results.
"""

from __future__ import annotations

import functools

import grpc
import pytest

from shared.proto import decoder_pb2_grpc


@pytest.fixture(scope="session")
def base_stub(redis_url, tmp_path_factory):
    from helpers.stacks import BASE, stack

    with stack(BASE, redis_url, tmp_path_factory.mktemp("base-logs")) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield decoder_pb2_grpc.DecoderServiceStub(channel)


@pytest.fixture(scope="session")
def base_case(base_stub):
    """``name -> Result``: ``BASE_CASES[name]`` sent alone on the base stack, once a session."""
    from test_e2e_whisper_options import run_case

    return functools.cache(lambda name: run_case(base_stub, name))
