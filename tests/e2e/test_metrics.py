"""Prometheus /metrics: the endpoint itself, and both real service processes scraped after requests."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers.metrics import scrape
from test_e2e_whisper import HF_RULES

from encdec import DATA_DIR
from encdec.launcher import Services
from encdec.redis_server import free_port, free_ports
from shared.metrics import EncoderMetrics, start_metrics_server
from shared.proto import decoder_pb2, decoder_pb2_grpc

DATA = DATA_DIR


def test_endpoint_serves_registry_and_survives_a_taken_port(caplog):
    metrics = EncoderMetrics()
    metrics.observe_encode(encode_ms=250.0, batch_size=3, transfer_bytes=1000, transfer_ms=2.0)
    assert not start_metrics_server(0, "127.0.0.1", metrics.registry)  # 0 = off
    port = free_port()
    assert start_metrics_server(port, "127.0.0.1", metrics.registry)
    got = scrape(port)
    assert got[("encdec_encoder_requests_total", (("outcome", "ok"),))] == 1
    assert got[("encdec_encoder_encode_seconds_sum", ())] == pytest.approx(0.25)
    assert got[("encdec_encoder_batch_size_bucket", (("le", "4.0"),))] == 1
    assert got[("encdec_encoder_batch_size_bucket", (("le", "2.0"),))] == 0
    assert got[("encdec_encoder_kv_transfer_bytes_total", ())] == 1000
    assert ("process_resident_memory_bytes", ()) in got
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with caplog.at_level(logging.ERROR, logger="shared.metrics"):
            assert not start_metrics_server(busy.getsockname()[1], "127.0.0.1", metrics.registry)
    assert "serving without /metrics" in caplog.text


@pytest.fixture(scope="module")
def services(redis_url, tmp_path_factory):
    ports = dict(zip(["decoder", "encoder"], free_ports(2), strict=True))  # two picks could be one port
    log_dir = tmp_path_factory.mktemp("metrics-logs")
    with Services(
        redis_url=redis_url,
        log_dir=str(log_dir),
        extra_decoder_args=["--metrics-port", str(ports["decoder"])],
        extra_encoder_args=["--metrics-port", str(ports["encoder"])],
    ) as svc:
        yield svc, ports


def test_services_expose_request_latency_kv_and_encoder_metrics(services):
    svc, ports = services
    audio = (DATA / "short.wav").read_bytes()
    with grpc.insecure_channel(svc.decoder_address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        full = list(stub.Generate(decoder_pb2.GenerateRequest(audio=audio), timeout=120))
        cut = list(
            stub.Generate(
                decoder_pb2.GenerateRequest(audio=audio, sampling=decoder_pb2.SamplingParams(max_tokens=2)), timeout=120
            )
        )
        stats = stub.GetStats(decoder_pb2.GetStatsRequest())
    assert (
        full[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP
        and cut[-1].finish_reason == decoder_pb2.FINISH_REASON_LENGTH
    )
    tokens = [sum(len(m.token_ids) for m in r) for r in (full, cut)]
    assert tokens[1] == 2

    d = scrape(ports["decoder"])
    assert d[("encdec_decoder_requests_total", (("finish_reason", "stop"), ("state", "finished")))] == 1
    assert d[("encdec_decoder_requests_total", (("finish_reason", "length"), ("state", "finished")))] == 1
    assert d[("encdec_decoder_time_to_first_token_seconds_count", ())] == 2
    assert (
        d[("encdec_decoder_time_per_output_token_seconds_count", ())] == sum(tokens) - 2
    )  # every token after the first
    assert d[("encdec_decoder_encode_seconds_count", ())] == 2 and d[("encdec_decoder_encode_seconds_sum", ())] > 0
    assert d[("encdec_decoder_kv_transfer_seconds_count", ())] == 2
    # Both requests' cross KV: 1500 positions x 4 layers x (K, V) x 6 heads x 64 x float32, at least.
    assert d[("encdec_decoder_kv_transfer_bytes_total", ())] >= 2 * 1500 * 4 * 2 * 6 * 64 * 4
    assert d[("encdec_decoder_num_requests_running", ())] == 0 and d[("encdec_decoder_num_requests_waiting", ())] == 0
    for group, total in (("self", stats.num_self_blocks), ("cross", stats.num_cross_blocks)):
        assert d[("encdec_decoder_kv_blocks", (("group", group),))] == total
        assert d[("encdec_decoder_kv_free_blocks", (("group", group),))] == total  # everything freed
    assert d[("encdec_decoder_num_preemptions_total", ())] == 0
    # One after the other, each request alone in its steps: one model step per generated token.
    assert d[("encdec_decoder_model_steps_total", ())] == d[("encdec_decoder_step_sequences_total", ())] == sum(tokens)
    assert stats.max_concurrent_requests == 16  # default pools: max_num_seqs (16) max-length requests

    e = scrape(ports["encoder"])
    assert e[("encdec_encoder_requests_total", (("outcome", "ok"),))] == 2
    assert e[("encdec_encoder_batch_size_count", ())] == 2
    assert e[("encdec_encoder_kv_transfer_bytes_total", ())] == d[("encdec_decoder_kv_transfer_bytes_total", ())]


def test_identical_concurrent_inputs_are_encoded_once(services):
    """Encoder cache: two requests with the same audio in flight together share one Encode's cross KV."""
    svc, ports = services
    audio = (DATA / "sample.wav").read_bytes()
    before_d, before_e = scrape(ports["decoder"]), scrape(ports["encoder"])
    barrier = threading.Barrier(2)
    id_a, id_b = f"cache-a-{uuid.uuid4().hex[:8]}", f"cache-b-{uuid.uuid4().hex[:8]}"  # fresh on a reused Redis

    states = {}

    def run(args):
        stub, request_id = args
        barrier.wait()
        messages = []
        for message in stub.Generate(
            # HF rules stream a short clip token by token: the first message arrives while the request decodes
            decoder_pb2.GenerateRequest(request_id=request_id, audio=audio, whisper=HF_RULES),
            timeout=120,
        ):
            if not messages:  # mid-stream: the record says DECODING, also for the request that reused the other's KV
                states[request_id] = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id)).state
            messages.append(message)
        return messages

    with grpc.insecure_channel(svc.decoder_address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(run, [(stub, id_a), (stub, id_b)])
        stats = stub.GetStats(decoder_pb2.GetStatsRequest())
        final = {r: stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=r)).state for r in states}
    assert states == {id_a: decoder_pb2.REQUEST_STATE_DECODING, id_b: decoder_pb2.REQUEST_STATE_DECODING}
    assert set(final.values()) == {decoder_pb2.REQUEST_STATE_FINISHED}
    tokens = [[t for m in r for t in m.token_ids] for r in (first, second)]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 5
    d, e = scrape(ports["decoder"]), scrape(ports["encoder"])
    hits = ("encdec_decoder_encoder_cache_hits_total", ())
    ok = ("encdec_encoder_requests_total", (("outcome", "ok"),))
    assert d[hits] - before_d.get(hits, 0) == 1
    assert e[ok] - before_e.get(ok, 0) == 1  # one Encode for both
    assert d[("encdec_decoder_encoder_cache_entries", ())] == 0  # evicted with the last holder
    assert stats.num_free_cross_blocks == stats.num_cross_blocks
