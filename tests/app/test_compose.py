"""compose.yaml's wiring, proven without a Docker engine.

The structural tests read compose.yaml as ``docker compose`` would and check the
deployment's promises (only public ports published, health checks over the gRPC
health service or, for the HTTP gateway, its /health, service_healthy
dependencies, the models volume, the gpu profile, every ENCDEC_* variable a real
config field). The end-to-end test runs each service's command as a local
process with its compose environment (``tests/helpers/compose_local.py``; a real
redis-server stands in for the redis image) and sends a Generate and an Embed
through the published ports, and /v1/models and a transcription through the
published HTTP port.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
import torch.nn.functional as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.compose_file import (
    Project,
    UnsupportedCompose,
    check_understood,
    interpolate,
    load_project,
    parse_duration,
    published_binds,
    published_ports,
)
from helpers.compose_local import LocalDeployment, local_command, remap
from helpers.embed_sentences import SENTENCES

from encdec import DATA_DIR
from encdec.redis_server import free_port
from gateway_svc.config import GatewayConfig
from shared.config import DecoderServiceConfig, EncoderServiceConfig, config_from

ROOT = Path(__file__).resolve().parents[2]
DATA = DATA_DIR
CONFIG_OF = {"serve-encoder": EncoderServiceConfig, "serve-decoder": DecoderServiceConfig, "serve-http": GatewayConfig}
MODEL_COMMANDS = {"serve-encoder", "serve-decoder"}  # hold a model (the gateway holds none)
CLI_ENV = {"ENCDEC_LOG_LEVEL"}  # read by encdec.cli, not a config field
DECODER_PORT, EMBED_PORT, HTTP_PORT = 50051, 50071, 8000  # the public ports


@pytest.fixture(scope="module")
def project() -> Project:
    return load_project(ROOT / "compose.yaml")


def encdec_services(project: Project) -> dict[str, dict]:
    return {n: s for n, s in project.services.items() if s["command"][0] == "encdec"}


def model_services(project: Project) -> dict[str, dict]:
    return {n: s for n, s in encdec_services(project).items() if s["command"][1] in MODEL_COMMANDS}


def gateways(project: Project) -> dict[str, dict]:
    return {n: s for n, s in encdec_services(project).items() if s["command"][1] == "serve-http"}


def in_profile(project: Project, profile: str) -> dict[str, dict]:
    return {n: s for n, s in project.services.items() if profile in s.get("profiles", [])}


def test_everything_in_compose_yaml_is_understood_and_the_translator_refuses_the_rest(project):
    check_understood(project)
    bad = dataclasses.replace(
        project, services={**project.services, "x": {**project.services["embed"], "restart": "always"}}
    )
    with pytest.raises(UnsupportedCompose, match="restart"):
        check_understood(bad)
    with pytest.raises(UnsupportedCompose, match="executable"):
        local_command(["sh", "-c", "true"])
    with pytest.raises(UnsupportedCompose, match="variable syntax"):
        interpolate({"a": ["$HOME"]}, {})
    assert interpolate("${A:-x}/${B-y}/${C}/$$", {"B": ""}) == "x///$"


def test_only_the_public_ports_are_published_and_redis_stays_internal(project):
    assert project.profiles == {"cpu"}, ".env must make a plain `docker compose up` the CPU set"
    redis = project.services["redis"]
    assert redis["image"].startswith("redis:") and "ports" not in redis and redis["networks"] == ["internal"]
    assert project.networks["internal"] == {"internal": True}
    for profile, suffix in (("cpu", ""), ("gpu", "-gpu")):
        services = in_profile(project, profile)
        assert set(services) == {f"encoder{suffix}", f"decoder{suffix}", f"embed{suffix}", f"http{suffix}"}
        published = {n: [h for h, _ in published_ports(s)] for n, s in services.items() if "ports" in s}
        assert published == {
            f"decoder{suffix}": [DECODER_PORT],
            f"embed{suffix}": [EMBED_PORT],
            f"http{suffix}": [HTTP_PORT],
        }
        binds = {n: [ip for ip, _, _ in published_binds(s)] for n, s in services.items() if "ports" in s}
        # The gRPC ports on loopback only (GRPC_BIND opts in to more); the HTTP API, behind its key, everywhere.
        assert binds == {
            f"decoder{suffix}": ["127.0.0.1"],
            f"embed{suffix}": ["127.0.0.1"],
            f"http{suffix}": ["0.0.0.0"],
        }
        assert services[f"encoder{suffix}"]["networks"] == ["internal"]  # Encode: internal only
        assert services[f"http{suffix}"]["networks"] == ["public"]  # reaches the decoder and embed, not Encode


def test_dependencies_wait_for_health_and_health_checks_use_grpc_or_http_health(project):
    for name, svc in project.services.items():
        for dep, spec in svc.get("depends_on", {}).items():
            if "healthcheck" in project.services[dep]:
                assert spec["condition"] == "service_healthy", (name, dep)
        for mode in ("ipc", "pid"):  # joining a namespace needs its owner up first
            if svc.get(mode, "").startswith("service:"):
                owner = svc[mode].removeprefix("service:")
                assert svc["depends_on"][owner]["condition"] == "service_healthy", (name, mode)
    for name, svc in model_services(project).items():
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"] and "grpc_health.v1" in test[3] and ".Check(" in test[3], name
    for name, svc in gateways(project).items():  # the image has no curl: python's urllib asks GET /health
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"] and "urllib.request" in test[3] and '"/health"' in test[3], name
    for name in ("decoder", "decoder-gpu"):
        assert set(project.services[name]["depends_on"]) == {"redis", name.replace("decoder", "encoder")}
    for name in ("http", "http-gpu"):
        suffix = name.removeprefix("http")
        assert set(project.services[name]["depends_on"]) == {f"decoder{suffix}", f"embed{suffix}"}


@pytest.mark.parametrize(
    ("service", "message"),
    [("decoder", "127.0.0.1:{port}: UNAVAILABLE"), ("http", "http://127.0.0.1:{port}/health: ")],
    ids=["decoder", "http"],
)
def test_health_check_command_fails_when_nothing_serves(project, service, message):
    port = free_port()
    env = {"ENCDEC_PORT": str(port), "PATH": "/usr/bin:/bin"}
    argv = local_command(project.services[service]["healthcheck"]["test"][1:])
    result = subprocess.run(argv, check=False, env=env, capture_output=True, timeout=60)
    assert result.returncode != 0 and message.format(port=port) in result.stderr.decode()


def test_environment_names_real_config_fields_and_validates(project, monkeypatch):
    # attention_backend=triton (gpu profile) is refused without a CUDA device unless Triton's CPU
    # interpreter is on: turn it on so the values themselves are validated on this GPU-less machine.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name, svc in encdec_services(project).items():
        cls = CONFIG_OF[svc["command"][1]]
        env = {k: str(v) for k, v in svc["environment"].items()}
        fields = {f"ENCDEC_{f.name.upper()}" for f in dataclasses.fields(cls)}
        unknown = {k for k in env if k.startswith("ENCDEC_")} - fields - CLI_ENV
        assert not unknown, f"{name}: {sorted(unknown)} are not {cls.__name__} fields"
        config = config_from(cls, env=env)  # raises on a value the service would refuse
        assert config.port == int(env["ENCDEC_PORT"]) and config.host == "0.0.0.0"


def test_each_gateway_reaches_its_profiles_decoder_and_embed_service(project):
    for name, svc in gateways(project).items():
        config = config_from(GatewayConfig, env={k: str(v) for k, v in svc["environment"].items()})
        # Issue 34: the HTTP port always needs a key: the secrets service's file (ENCDEC_API_KEY, else generated)
        assert not config.api_key and config.api_key_file == "/run/encdec-api/api-key"
        assert "api-key:/run/encdec-api" in svc["volumes"]
        for targets, role in ((config.decoder_targets, "decoder"), (config.embed_targets, "embed")):
            assert len(targets) == 1, (name, role)
            host, _, port = targets[0].rpartition(":")
            backend = project.services[host]
            assert backend["command"][1] == ("serve-decoder" if role == "decoder" else "serve-encoder"), (name, host)
            assert port in backend["expose"] and backend["profiles"] == svc["profiles"], (name, host)
            assert set(backend["networks"]) & set(svc["networks"]), (name, host)


def test_each_decoder_and_its_encoder_agree_on_the_kv_transport(project, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as above: lets attention_backend=triton validate here
    for name, svc in encdec_services(project).items():
        if svc["command"][1] != "serve-decoder":
            continue
        decoder = config_from(DecoderServiceConfig, env={k: str(v) for k, v in svc["environment"].items()})
        encoder_name, _, encoder_port = decoder.encoder_address.rpartition(":")
        encoder_svc = project.services[encoder_name]
        assert encoder_port in encoder_svc["expose"] and not set(encoder_svc.get("profiles", [])).isdisjoint(
            svc["profiles"]
        )
        encoder = config_from(EncoderServiceConfig, env={k: str(v) for k, v in encoder_svc["environment"].items()})
        assert decoder.kv_transport in encoder.kv_transport.split(","), (name, encoder_name)
        if decoder.kv_transport == "cuda_ipc":
            assert decoder.kv_device.startswith("cuda"), name
        # The drain (shutdown grace, then up to ~4 s to end the rest) ends before compose's SIGKILL.
        grace = svc.get("stop_grace_period")
        assert grace and parse_duration(grace) >= decoder.shutdown_grace_s + 4, (name, grace, decoder.shutdown_grace_s)


def test_encoders_and_decoders_share_the_internal_token_and_nothing_else_sees_it(project):
    """Encode takes only the deployment's token (shared/internal_auth.py): each encoder writes it to the
    internal-token volume on its first start, its decoder (started once the encoder is healthy) reads it there;
    the public embed services and HTTP gateways do not mount it."""
    assert "internal-token" in project.volumes
    for name, svc in encdec_services(project).items():
        path = svc["environment"].get("ENCDEC_INTERNAL_TOKEN_FILE")
        if name.startswith(("embed", "http")):
            assert path is None and not any(str(m).startswith("internal-token:") for m in svc.get("volumes", [])), name
            continue
        mount = next(m for m in svc["volumes"] if str(m).startswith("internal-token:"))
        assert path == mount.partition(":")[2] + "/internal-token", name
    for name in ("decoder", "decoder-gpu"):
        encoder = name.replace("decoder", "encoder")
        assert project.services[name]["depends_on"][encoder]["condition"] == "service_healthy"
    dockerfile = (ROOT / "Dockerfile").read_text()  # a new named volume takes the image's owner of its mount point
    assert re.search(r"mkdir [^\n]*/secrets[^\n]*chown encdec:encdec [^\n]*/secrets", dockerfile)


def test_public_grpc_ports_require_the_backend_token_the_gateway_sends(project):
    """Issue 34 item 1: with ENCDEC_API_KEY set, the published gRPC ports were an open way around it. The secrets
    service generates a backend token into the backend-token volume; every decoder and embed service requires
    it on its public port, every gateway sends it, and no encoder or Redis sees it."""
    assert "backend-token" in project.volumes
    secrets = project.services["secrets"]
    assert "backend-token:" + secrets["environment"]["BACKEND_TOKEN_DIR"] in secrets["volumes"]
    token = secrets["environment"]["BACKEND_TOKEN_DIR"] + "/backend-token"
    for name, svc in encdec_services(project).items():
        env, mounted = svc["environment"], any(str(m).startswith("backend-token:") for m in svc.get("volumes", []))
        if name.startswith(("decoder", "embed")):
            assert env["ENCDEC_AUTH_TOKEN_FILE"] == token and mounted, name
            assert svc["depends_on"].get("secrets", {}).get("condition") == "service_completed_successfully" or (
                name.startswith("decoder")  # through redis, which waits for secrets
            ), name
        elif name.startswith("http"):
            assert env["ENCDEC_BACKEND_TOKEN_FILE"] == token and mounted, name
        else:
            assert "ENCDEC_AUTH_TOKEN_FILE" not in env and not mounted, name
    assert not any(str(m).startswith("backend-token:") for m in project.services["redis"]["volumes"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"mkdir [^\n]*/run/encdec-backend[^\n]*chown encdec:encdec [^\n]*/run/encdec-backend", dockerfile)


def test_models_volume_and_gpu_profile(project):
    assert "models" in project.volumes
    for name, svc in model_services(project).items():
        assert "models:/models" in svc["volumes"], name
    for name, svc in gateways(project).items():  # no model: neither the volume nor a GPU (the token and API key)
        assert svc["volumes"] == ["backend-token:/run/encdec-backend", "api-key:/run/encdec-api"], name
        assert "deploy" not in svc, name
    gpu = in_profile(project, "gpu")
    for name, svc in gpu.items():
        if name in model_services(project):
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        cpu_twin = project.services[name.removesuffix("-gpu")]
        assert svc["command"] == cpu_twin["command"] and svc.get("ports") == cpu_twin.get("ports"), name
        assert svc["image"].endswith(":cuda") and cpu_twin["image"].endswith(":cpu"), name
        assert "deploy" not in cpu_twin
    env = gpu["decoder-gpu"]["environment"]
    assert env["ENCDEC_KV_TRANSPORT"] == "cuda_ipc" and env["ENCDEC_ATTENTION_BACKEND"] == "triton"
    assert env["ENCDEC_KV_DEVICE"] == "cuda"
    assert gpu["decoder-gpu"]["ipc"] == gpu["decoder-gpu"]["pid"] == "service:encoder-gpu"


def test_every_service_runs_on_a_read_only_root_filesystem_with_tmpfs_where_it_writes(project):
    """``read_only: true`` everywhere (issue 34 item 9): a service writes only to its volumes, /dev/shm and its
    tmpfs: /tmp for every encdec service (spooled uploads, torch, Triton's build), and $HOME for the model services
    (caches: models assembled from parts, ~/.triton), owned by the image's user. tests/deploy's read-only check
    says how that was measured."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid, user = re.search(r"useradd --create-home --uid (\d+) (\w+)", dockerfile).groups()
    for name, svc in project.services.items():
        assert svc.get("read_only") is True, name
        tmpfs = dict(m.partition(":")[::2] for m in svc.get("tmpfs", []))
        for path, options in tmpfs.items():
            assert "size=" in options, (name, path)  # memory: capped
        if svc["command"][0] == "encdec":
            assert "/tmp" in tmpfs, name
        if name in model_services(project):
            options = dict(o.partition("=")[::2] for o in tmpfs[f"/home/{user}"].split(","))
            assert options["uid"] == options["gid"] == uid and options["mode"] == "0700", name
    redis = project.services["redis"]["command"]
    assert redis[redis.index("--maxmemory-policy") + 1] == "noeviction"  # why: tests/deploy, compose.yaml


def test_image_installs_like_setup_sh_and_puts_its_venv_first(project):
    dockerfile = (ROOT / "Dockerfile").read_text()
    declared = dict(re.findall(r"^ARG (\w+)(?:=(.*))?$", dockerfile, flags=re.MULTILINE))
    for name, svc in project.services.items():
        assert set(svc.get("build", {}).get("args", {})) <= set(declared), name
    assert "embed" in declared["EXTRAS"].split(",")  # the embed service's default model
    assert 'TORCH_INDEX_URL="$TORCH_INDEX_URL" EXTRAS="$EXTRAS" bash scripts/setup.sh' in dockerfile
    # `encdec` and `python` in commands and health checks are the venv's, as the local run assumes
    assert re.search(r"^ENV PATH=/app/.venv/bin:\$PATH", dockerfile, flags=re.MULTILINE)


def test_remap_rewrites_hosts_and_ports_consistently():
    endpoints = {
        ("decoder", 50051): ("127.0.0.1", 41001),
        ("encoder", 50061): ("127.0.0.1", 41002),
        ("redis", 6379): ("127.0.0.1", 41003),
    }
    assert remap("encoder:50061", "decoder", endpoints) == "127.0.0.1:41002"
    assert remap("redis://redis:6379/0", "decoder", endpoints) == "redis://127.0.0.1:41003/0"
    assert remap("50051", "decoder", endpoints, key="ENCDEC_PORT") == "41001"
    assert remap("0.0.0.0", "decoder", endpoints) == "127.0.0.1"
    assert remap("localhost:50051", "decoder", endpoints) == "127.0.0.1:41001"
    assert remap("example.com:443", "decoder", endpoints) == "example.com:443"
    mounts = {"/secrets": "/tmp/vol/internal-token"}
    assert (
        remap("/secrets/internal-token", "decoder", endpoints, mounts=mounts)
        == "/tmp/vol/internal-token/internal-token"
    )
    assert remap("/secretsx", "decoder", endpoints, mounts=mounts) == "/secretsx"
    with pytest.raises(UnsupportedCompose):
        remap("encoder:9999", "decoder", endpoints)
    with pytest.raises(UnsupportedCompose):
        remap("50061", "decoder", endpoints, key="ENCDEC_PORT")


# ---- end to end: the CPU deployment as local processes ---------------------------------------------------
@pytest.fixture(scope="module")
def deployment(project, redis_url, tmp_path_factory):
    with LocalDeployment(project, redis_url, tmp_path_factory.mktemp("compose-logs")) as running:
        yield running


def _token(deployment) -> tuple[tuple[str, str]]:
    """The gRPC metadata of the deployment's backend token (the secrets service wrote it, mode 0600)."""
    path = Path(deployment.env("decoder")["ENCDEC_AUTH_TOKEN_FILE"])
    assert path.stat().st_mode & 0o777 == 0o600
    return (("authorization", f"Bearer {path.read_text().strip()}"),)


def _serving(address: str, service: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
    return status == health_pb2.HealthCheckResponse.SERVING


def test_generate_through_the_published_decoder_port(deployment, hf_whisper, whisper_features):
    from shared.models.registry import resolve_model
    from shared.models.whisper_features import load_tokenizer
    from shared.proto import decoder_pb2, decoder_pb2_grpc

    assert _serving(deployment.service_address("encoder"), "encdec.v1.EncoderService")
    with torch.inference_mode():
        expected = hf_whisper.generate(whisper_features["short.wav"][None]).tolist()[0]  # the e2e tests' truth
    with grpc.insecure_channel(deployment.published(DECODER_PORT)) as ch:
        stub = decoder_pb2_grpc.DecoderServiceStub(ch)
        messages = list(
            stub.Generate(
                decoder_pb2.GenerateRequest(audio=(DATA / "short.wav").read_bytes()),
                timeout=120,
                metadata=_token(deployment),
            )
        )
        tokens = [t for m in messages for t in m.token_ids]
        assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP
        assert tokens[:-1] == expected and tokens[-1] == 50256
        text = "".join(m.text for m in messages)
        assert text == load_tokenizer(resolve_model("whisper-tiny.en")[1]).decode(tokens, skip_special_tokens=True)
        record = stub.GetRequest(  # from Redis
            decoder_pb2.GetRequestRequest(request_id=messages[0].request_id), metadata=_token(deployment)
        )
        assert record.state == decoder_pb2.REQUEST_STATE_FINISHED and record.finish_reason == "stop"
    for name, metric in (("decoder", "encdec_decoder_requests_total"), ("encoder", "encdec_encoder_requests_total")):
        host, port = deployment.endpoints[
            (name, int(deployment.project.services[name]["environment"]["ENCDEC_METRICS_PORT"]))
        ]
        with urllib.request.urlopen(
            f"http://{host}:{port}/metrics", timeout=10
        ) as resp:  # ENCDEC_METRICS_PORT honoured
            assert metric in resp.read().decode(), name


def test_encode_without_the_internal_token_is_refused(deployment):
    """The encoder of the deployment refuses an Encode that lacks the token the decoder uses (the Generate
    above went through with it); the token file lives on the shared volume, mode 0600."""
    from shared.proto import encoder_pb2, encoder_pb2_grpc

    token_file = Path(deployment.env("encoder")["ENCDEC_INTERNAL_TOKEN_FILE"])
    assert token_file == Path(deployment.env("decoder")["ENCDEC_INTERNAL_TOKEN_FILE"])
    assert token_file.stat().st_mode & 0o777 == 0o600
    with grpc.insecure_channel(deployment.service_address("encoder")) as ch:
        with pytest.raises(grpc.RpcError) as info:
            encoder_pb2_grpc.EncoderServiceStub(ch).Encode(encoder_pb2.EncodeRequest(request_id="x"), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()


def test_redis_takes_only_the_password_the_secrets_service_generated(deployment):
    """The one-shot secrets service wrote the password (mode 0600) into the redis-secret volume; redis started
    with it (redis.conf's requirepass) and refuses a client without it; the decoder's Generate above got in."""
    import redis

    password_file = Path(deployment.env("decoder")["ENCDEC_REDIS_PASSWORD_FILE"])
    assert password_file.stat().st_mode & 0o777 == 0o600 and len(password_file.read_text().strip()) == 64
    assert "secrets" in deployment.completed
    host, port = deployment.endpoints[("redis", 6379)]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=port, socket_timeout=5).get("x")
    assert redis.Redis(host=host, port=port, password=password_file.read_text().strip(), socket_timeout=5).ping()


def test_published_grpc_ports_refuse_calls_without_the_backend_token(deployment):
    """Issue 34 item 1: Generate, GetRequest and Abort on the published decoder port and Embed on the embed port
    are UNAUTHENTICATED without the backend token (or with another); health stays open for probes."""
    from shared.proto import decoder_pb2, decoder_pb2_grpc, embed_pb2, embed_pb2_grpc

    wrong = (("authorization", "Bearer not-the-deployment-token"),)
    with grpc.insecure_channel(deployment.published(DECODER_PORT)) as ch:
        stub = decoder_pb2_grpc.DecoderServiceStub(ch)
        calls = [
            lambda m: list(
                stub.Generate(
                    decoder_pb2.GenerateRequest(audio=(DATA / "short.wav").read_bytes()), timeout=30, metadata=m
                )
            ),
            lambda m: stub.GetRequest(decoder_pb2.GetRequestRequest(request_id="x"), timeout=30, metadata=m),
            lambda m: stub.Abort(decoder_pb2.AbortRequest(request_id="x"), timeout=30, metadata=m),
        ]
        for call in calls:
            for metadata in (None, wrong):
                with pytest.raises(grpc.RpcError) as info:
                    call(metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    with grpc.insecure_channel(deployment.published(EMBED_PORT)) as ch:
        with pytest.raises(grpc.RpcError) as info:
            embed_pb2_grpc.EmbedServiceStub(ch).Embed(embed_pb2.EmbedRequest(inputs=["x"]), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _serving(deployment.published(DECODER_PORT), "encdec.v1.DecoderService")


def test_embed_through_the_published_embed_port(deployment):
    from encoder_svc.embed.engine import finish_embedding, load_embed_engine
    from shared.proto import embed_pb2, embed_pb2_grpc

    address = deployment.published(EMBED_PORT)
    assert _serving(address, "encdec.v1.EmbedService")
    texts = SENTENCES[:6]
    with grpc.insecure_channel(address) as ch:
        resp = embed_pb2_grpc.EmbedServiceStub(ch).Embed(
            embed_pb2.EmbedRequest(inputs=texts), timeout=60, metadata=_token(deployment)
        )
    assert resp.model == "all-MiniLM-L6-v2" and len(resp.embeddings) == len(texts)
    engine = load_embed_engine("all-MiniLM-L6-v2")  # checked against sentence-transformers in test_embed_minilm
    seqs = engine.tokenize(texts, truncate=False)
    ref = torch.stack([finish_embedding(v, True, 0) for v in engine.forward(seqs, ["mean"] * len(seqs))])
    got = torch.tensor([list(e.values) for e in resp.embeddings])
    assert got.shape == (len(texts), 384)
    assert F.cosine_similarity(got, ref, dim=1).min().item() >= 0.99999


def test_http_gateway_through_the_published_http_port(deployment):
    """The gateway lists the decoder's and the embed service's models and answers a transcription of a bundled
    clip with the decoder's own transcript (Generate over the published decoder port)."""
    import httpx

    from shared.proto import decoder_pb2, decoder_pb2_grpc

    url = "http://" + deployment.published(HTTP_PORT)
    audio = (DATA / "short.wav").read_bytes()
    with grpc.insecure_channel(deployment.published(DECODER_PORT)) as ch:
        messages = decoder_pb2_grpc.DecoderServiceStub(ch).Generate(
            decoder_pb2.GenerateRequest(audio=audio), timeout=120, metadata=_token(deployment)
        )
        expected = "".join(m.text for m in messages).strip()
    assert expected
    key = Path(deployment.env("http")["ENCDEC_API_KEY_FILE"]).read_text().strip()  # the secrets service's
    with httpx.Client(base_url=url, timeout=120) as client:
        assert client.get("/v1/models").status_code == 401  # secure by default: no key, no API (issue 34)
        client.headers["Authorization"] = f"Bearer {key}"
        health = client.get("/health")
        counts = health.json()["backends"]  # counts only: /health is open to all (issue 34 item 8)
        assert health.status_code == 200 and counts["serving"] == counts["total"] > 0, health.text
        models = client.get("/v1/models").json()
        assert models["object"] == "list"
        assert {m["id"] for m in models["data"]} == {"whisper-tiny.en", "all-MiniLM-L6-v2"}
        answer = client.post(
            "/v1/audio/transcriptions",
            files={"file": ("short.wav", audio, "audio/wav")},
            data={"model": "whisper-tiny.en"},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"] == expected
