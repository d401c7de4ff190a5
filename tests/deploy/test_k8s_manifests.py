"""deploy/k8s/: every placement renders, validates against the Kubernetes 1.37 schemas (strict), and keeps the
deployment's promises (issue 23).

``render`` is a tiny kustomize that knows only what the manifests use (``resources:`` files and directories
with a kustomization.yaml of their own) and refuses anything else, so a feature added to a kustomization fails
here instead of being skipped; where ``kubectl`` is on PATH its ``kubectl kustomize`` output must equal ours.
The rules read the services' own settings through ``shared.config.config_from`` (the values the processes
would run with, defaults included): probes on each container's gRPC port, termination grace above the
decoder's drain, no public Service for Encode / torch_dist / Redis, NetworkPolicies that admit those ports only
from our pods, PDB / HPA targets, resources, Secrets only by reference. Issue 34 item 9: read-only root filesystems
with emptyDirs where the processes write, an egress policy per component naming only what it calls, Redis capped
with ``maxmemory`` and never evicting.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway_svc.config import GatewayConfig
from shared.config import DecoderServiceConfig, EncoderServiceConfig, config_from

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')"
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PLACEMENTS = ("colocated", "split", "gpu", "gpu-split")
SPLIT = ("split", "gpu-split")  # encoder and decoder Deployments, KV over torch_dist
K8S_VERSION = "1.37.0"  # the schemas of the pinned kubernetes-validate
CONFIG_OF = {"serve-encoder": EncoderServiceConfig, "serve-decoder": DecoderServiceConfig, "serve-http": GatewayConfig}
INTERNAL_PORTS = {50061: "Encode", 6379: "Redis", 29500: "torch_dist"}
DRAIN_MARGIN_S = 4  # after shutdown_grace_s the decoder ends the rest within ~4 s
SECRET = "encdec-secrets"
POD_IP = "10.0.0.7"  # stands in for $(POD_IP) when a container's settings are read
OURS = {"app.kubernetes.io/name": "encdec-serve"}
OUR_NAMESPACE = {"kubernetes.io/metadata.name": "encdec"}  # where the placement is applied (any namespace)
KUBE_DNS = ({"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"})  # CoreDNS, as clusters label it
OUTSIDE = None  # an address outside the cluster (the internet, a node, a cloud metadata service)
ANY = "any port"


class UnsupportedKustomization(ValueError):
    """A kustomization uses a feature ``render`` does not implement."""


# ---- rendering -------------------------------------------------------------------------------------------
def render(directory: Path) -> list[dict]:
    """The documents ``kubectl kustomize directory`` builds, for kustomizations of plain ``resources:``.

    Raises:
        UnsupportedKustomization: any other field, a remote or missing resource, or two documents with the
            same kind and name (kustomize refuses those too).
    """
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if spec.get("apiVersion") != "kustomize.config.k8s.io/v1beta1" or spec.get("kind") != "Kustomization":
        raise UnsupportedKustomization(f"{directory}: not a kustomize.config.k8s.io/v1beta1 Kustomization")
    unknown = set(spec) - {"apiVersion", "kind", "resources"}
    if unknown:
        raise UnsupportedKustomization(f"{directory}/kustomization.yaml: {sorted(unknown)} not supported here")
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if "://" in entry or not path.exists():
            raise UnsupportedKustomization(f"{directory}: resource {entry!r} is not a local file or directory")
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    seen = set()
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        if key in seen:
            raise UnsupportedKustomization(f"{directory}: {key} defined twice")
        seen.add(key)
    return docs


@pytest.fixture(scope="module", params=PLACEMENTS)
def placement(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Deployment name -> its pod template."""
    return {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(docs, "Deployment")}


def containers(pod: dict) -> list[dict]:
    """Every container of a pod template, native sidecars (init containers that restart) included."""
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


def command(container: dict) -> str | None:
    """``serve-encoder`` / ``serve-decoder`` / ``serve-http`` for an encdec container, else None."""
    cmd = container.get("command", [])
    return cmd[1] if cmd[:1] == ["encdec"] else None


def settings(container: dict):
    """The container's config as its process reads it (``$(POD_IP)`` filled in, Secret references stubbed)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"].replace("$(POD_IP)", POD_IP)
        elif "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = "s" * 32
    return config_from(CONFIG_OF[command(container)], env=env)


def encdec_containers(docs: list[dict]):
    for name, pod in pod_templates(docs).items():
        for c in containers(pod):
            if command(c):
                yield name, pod, c


def matches(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels + matchExpressions) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def container_ports(pod: dict) -> dict[str | int, int]:
    """Port name and number -> number, over every container of the pod."""
    out: dict[str | int, int] = {}
    for c in containers(pod):
        for p in c.get("ports", []):
            out[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                out[p["name"]] = p["containerPort"]
    return out


# ---- the loader itself -------------------------------------------------------------------------------------
def test_render_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [a.yaml]\npatches: [p.yaml]\n"
    )
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: a}\n")
    with pytest.raises(UnsupportedKustomization, match="patches"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [a.yaml, a.yaml]\n"
    )
    with pytest.raises(UnsupportedKustomization, match="twice"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [missing.yaml]\n"
    )
    with pytest.raises(UnsupportedKustomization, match="missing"):
        render(tmp_path)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on PATH to compare with")
def test_render_equals_kubectl_kustomize(placement):
    name, docs = placement
    out = subprocess.run(["kubectl", "kustomize", str(K8S / name)], check=True, capture_output=True, timeout=60)
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]

    def key(d):
        return (d["kind"], d["metadata"]["name"])

    assert sorted(theirs, key=key) == sorted(docs, key=key)


# ---- schemas ---------------------------------------------------------------------------------------------
def test_every_document_validates_against_the_kubernetes_schemas(placement):
    _, docs = placement
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_environment_names_real_config_fields_and_validates(placement, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets attention_backend=triton (gpu/) validate without a GPU
    _, docs = placement
    for deployment, _, c in encdec_containers(docs):
        cls = CONFIG_OF[command(c)]
        fields = {f"ENCDEC_{f.name.upper()}" for f in dataclasses.fields(cls)}
        unknown = {v["name"] for v in c.get("env", []) if v["name"].startswith("ENCDEC_")} - fields
        assert not unknown, f"{deployment}/{c['name']}: {sorted(unknown)} are not {cls.__name__} fields"
        assert settings(c).host == "0.0.0.0", (deployment, c["name"])  # the kubelet probes the pod IP


# ---- probes, grace, resources, security context --------------------------------------------------------------
def test_every_encdec_container_probes_its_own_grpc_port(placement):
    _, docs = placement
    seen = set()
    for deployment, _, c in encdec_containers(docs):
        where = f"{deployment}/{c['name']}"
        exposed = {p["containerPort"] for p in c.get("ports", [])}
        port = settings(c).port
        assert port in exposed, where
        seen.add(command(c))
        if command(c) == "serve-http":  # the gateway speaks HTTP: /health says whether its backends serve
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}, where
            assert c["livenessProbe"], where
            continue
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["grpc"] == {"port": port}, (where, probe)
    assert {"serve-encoder", "serve-decoder", "serve-http"} <= seen


def test_termination_grace_outlasts_the_decoders_drain(placement):
    _, docs = placement
    decoders = 0
    for deployment, pod, c in encdec_containers(docs):
        if command(c) != "serve-decoder":
            continue
        decoders += 1
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        drain = sleep_s + settings(c).shutdown_grace_s + DRAIN_MARGIN_S
        assert pod["spec"]["terminationGracePeriodSeconds"] > drain, (deployment, drain)
    assert decoders == 1


def test_every_container_requests_resources_and_runs_as_the_images_non_root_user(placement):
    _, docs = placement
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.search(r"useradd [^\n]*--uid (\d+) encdec", dockerfile)[1])
    assert re.search(r"^USER encdec$", dockerfile, flags=re.MULTILINE)
    for deployment, pod in pod_templates(docs).items():
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and isinstance(security["runAsUser"], int), deployment
        for c in containers(pod):
            where = f"{deployment}/{c['name']}"
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
            assert "memory" in c["resources"]["limits"], where
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            if command(c):
                assert security["runAsUser"] == uid, where


def volumes_at(pod: dict, container: dict) -> dict[str, dict]:
    """mountPath -> the pod volume mounted there, for one container."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def test_every_container_has_a_read_only_root_filesystem_and_emptydirs_where_it_writes(placement):
    """Measured with a read-only root (``unshare``, only /tmp writable): ``encdec up`` with an embed model served a
    transcription, an embedding and a 3 MB upload. $HOME takes the caches that other models and the GPU write
    (a whisper-base assembled from parts in ~/.cache/encdec, Triton's ~/.triton, CUDA's ~/.nv)."""
    _, docs = placement
    dockerfile = (ROOT / "Dockerfile").read_text()
    home = "/home/" + re.search(r"useradd --create-home [^\n]*--uid \d+ (\w+)", dockerfile)[1]
    for deployment, pod in pod_templates(docs).items():
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, deployment
        for c in containers(pod):
            where = f"{deployment}/{c['name']}"
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"], where
            assert "privileged" not in security and "add" not in security["capabilities"], where
            mounts = volumes_at(pod, c)
            read_only = {m["mountPath"] for m in c.get("volumeMounts", []) if m.get("readOnly")}
            writable = {path for path, v in mounts.items() if "emptyDir" in v and path not in read_only}
            if command(c):
                assert "/tmp" in writable, where  # python-multipart's spooled uploads, torch, Triton's gcc
            if command(c) in ("serve-encoder", "serve-decoder"):
                assert home in writable, where
            if c["name"] == "redis":
                assert "/data" in writable, where  # its working directory (nothing saved: --save '')
            for path in writable:  # a full node disk evicts every pod on it; a sizeLimit evicts only this one
                assert mounts[path]["emptyDir"].get("sizeLimit"), f"{where}: {path} without a sizeLimit"


# ---- exposure ---------------------------------------------------------------------------------------------
def test_no_public_service_exposes_encode_torch_dist_or_redis(placement):
    _, docs = placement
    pods = pod_templates(docs)
    public = 0
    for svc in of_kind(docs, "Service"):
        spec, name = svc["spec"], svc["metadata"]["name"]
        selected = [p for p in pods.values() if matches({"matchLabels": spec["selector"]}, p["metadata"]["labels"])]
        assert selected, f"Service {name} selects no pod"
        targets = set()
        for port in spec["ports"]:
            target = port.get("targetPort", port["port"])
            resolved = {container_ports(p).get(target) for p in selected}
            assert None not in resolved, f"Service {name}: targetPort {target!r} is no container port"
            targets |= resolved | {port["port"]}
        if spec.get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
            public += 1
            assert not targets & set(INTERNAL_PORTS), f"Service {name} is public and exposes {targets}"
    assert public == 3  # decoder, embed, HTTP gateway


def admitted(docs: list[dict], pod_labels: dict, port: int, peer: dict | None, pod: dict) -> bool:
    """Whether the NetworkPolicies let ``peer`` (a pod's labels in this namespace; None: outside the cluster)
    connect to ``port`` of a pod labelled ``pod_labels``."""
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if matches(p["spec"]["podSelector"], pod_labels) and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return True  # not isolated
    named = container_ports(pod)
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = {named.get(p["port"], p["port"]) for p in rule.get("ports", [])}
            if ports and port not in ports:
                continue
            sources = rule.get("from")
            if not sources:
                return True
            for source in sources:
                if "ipBlock" in source and peer is None:
                    return True
                if "namespaceSelector" in source and peer is not None:
                    return True  # would admit pods of other namespaces too: counted as admitting
                if set(source) == {"podSelector"} and peer is not None and matches(source["podSelector"], peer):
                    return True
    return False


def test_network_policies_keep_encode_torch_dist_and_redis_to_our_pods(placement):
    name, docs = placement
    pods = pod_templates(docs)
    labels = {n: p["metadata"]["labels"] for n, p in pods.items()}
    stranger = {"app": "someone-else"}
    protected = 0
    for deployment, pod in pods.items():
        for port in set(container_ports(pod).values()) & set(INTERNAL_PORTS):
            protected += 1
            where = f"{deployment}:{port} ({INTERNAL_PORTS[port]})"
            assert not admitted(docs, labels[deployment], port, None, pod), f"{where} reachable from outside"
            assert not admitted(docs, labels[deployment], port, stranger, pod), f"{where} reachable by any pod"
            for other, other_labels in labels.items():
                if not other_labels.items() >= OURS.items():
                    assert not admitted(docs, labels[deployment], port, other_labels, pod), (where, other)
    assert protected >= (3 if name in SPLIT else 1)
    # ...and the pods that need them still get through.
    decoder = labels["encdec-decoder"]
    assert admitted(docs, labels["encdec-redis"], 6379, decoder, pods["encdec-redis"])
    assert not admitted(docs, labels["encdec-redis"], 6379, labels["encdec-gateway"], pods["encdec-redis"])
    assert admitted(docs, decoder, 50051, None, pods["encdec-decoder"])  # the public API
    if name in SPLIT:
        encoder = labels["encdec-encoder"]
        assert admitted(docs, encoder, 50061, decoder, pods["encdec-encoder"])
        assert admitted(docs, decoder, 29500, encoder, pods["encdec-decoder"])
        assert admitted(docs, labels["encdec-redis"], 6379, encoder, pods["encdec-redis"])  # registers itself


def policy_types(policy: dict) -> list[str]:
    """A NetworkPolicy's policyTypes, with Kubernetes' default (Ingress, plus Egress when it has egress rules)."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def egress_allowed(
    docs: list[dict], pod_labels: dict, peer: tuple[dict, dict] | None, port: int, protocol="TCP"
) -> bool:
    """Whether the NetworkPolicies let a pod labelled ``pod_labels`` connect to ``port`` of ``peer``: (namespace
    labels, pod labels) of a pod, or ``OUTSIDE`` (None) for an address outside the cluster. An ipBlock counts as
    reaching outside; a pod selector without a namespace selector means our namespace."""
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if matches(p["spec"]["podSelector"], pod_labels) and "Egress" in policy_types(p)
    ]
    if not policies:
        return True  # not isolated for egress
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("protocol", "TCP") == protocol and p.get("port", port) == port for p in ports):
                continue
            for dest in rule.get("to") or [{"ipBlock": {"cidr": "0.0.0.0/0"}}]:  # no `to`: every destination
                if "ipBlock" in dest:
                    if peer is OUTSIDE or dest["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0"):
                        return True
                    continue
                if peer is OUTSIDE:
                    continue
                namespace, labels = peer
                in_namespace = (
                    matches(dest["namespaceSelector"], namespace)
                    if "namespaceSelector" in dest
                    else namespace == OUR_NAMESPACE
                )
                if in_namespace and matches(dest.get("podSelector", {}), labels):
                    return True
    return False


def test_each_component_reaches_only_what_it_calls(placement):
    """Egress: the gateway the decoder and embed APIs; decoders Redis (and, split, the encoders: Encode and the
    torch_dist pairs); encoders Redis and the decoders; embed nothing; Redis nothing at all; DNS for all but
    Redis. Never an address outside the cluster, another namespace's pods, or a port of ours they do not use."""
    name, docs = placement
    pods = pod_templates(docs)
    labels = {n: p["metadata"]["labels"] for n, p in pods.items()}
    ours = {n: (OUR_NAMESPACE, lab) for n, lab in labels.items()}
    stranger = (OUR_NAMESPACE, {"app": "someone-else"})
    elsewhere = ({"kubernetes.io/metadata.name": "other"}, labels["encdec-redis"])  # our labels, another namespace
    may = {  # deployment -> {(peer deployment, port or ANY)}; every other pair of ours is refused
        "encdec-gateway": {("encdec-decoder", 50051), ("encdec-embed", 50071)},
        "encdec-decoder": {("encdec-redis", 6379)},
        "encdec-embed": set(),
        "encdec-redis": set(),
    }
    if name in SPLIT:
        # Encode, the TCPStore (29500) and the Gloo / NCCL pair connections, on ports the backend picks: every port
        may["encdec-decoder"] |= {("encdec-encoder", ANY)}
        may["encdec-encoder"] = {("encdec-redis", 6379), ("encdec-decoder", ANY)}
    assert set(may) == set(pods)
    ports = {50051, 50061, 50071, 6379, 29500, 9400, 9401, 8000, 40123}  # 40123: a pair port
    for deployment, allowed in may.items():
        own = labels[deployment]
        assert any(
            "Egress" in policy_types(p) and matches(p["spec"]["podSelector"], own)
            for p in of_kind(docs, "NetworkPolicy")
        ), f"{deployment}: no egress policy"
        for port in ports | {443, 53}:
            assert not egress_allowed(docs, own, OUTSIDE, port), f"{deployment} reaches outside on {port}"
            assert not egress_allowed(docs, own, stranger, port), f"{deployment} reaches any pod on {port}"
            assert not egress_allowed(docs, own, elsewhere, port), f"{deployment} reaches another namespace on {port}"
            for peer in pods:
                got = egress_allowed(docs, own, ours[peer], port)
                assert got == bool({(peer, port), (peer, ANY)} & allowed), (deployment, peer, port, got)
        dns = all(egress_allowed(docs, own, KUBE_DNS, 53, protocol) for protocol in ("UDP", "TCP"))
        assert dns == (deployment != "encdec-redis"), deployment
        assert not egress_allowed(docs, own, KUBE_DNS, 443), deployment  # DNS, not the whole DNS pod


def test_pdbs_and_hpas_target_existing_deployments(placement):
    _, docs = placement
    pods = pod_templates(docs)
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        hits = [n for n, p in pods.items() if matches(pdb["spec"]["selector"], p["metadata"]["labels"])]
        assert len(hits) == 1, (pdb["metadata"]["name"], hits)
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    for target, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2" and target in pods, target
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": target}
        assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
        assert "replicas" in next(d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == target)["spec"]
    assert "encdec-decoder" in hpas
    covered = {n for n, p in pods.items() for b in of_kind(docs, "PodDisruptionBudget")
               if matches(b["spec"]["selector"], p["metadata"]["labels"])}  # fmt: skip
    assert {"encdec-decoder", "encdec-embed", "encdec-gateway"} <= covered


def memory_bytes(text: str) -> int:
    """A Kubernetes quantity (``512Mi``) or a redis-server size (``384mb``) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", text).groups()
    scale = {"": 1, "ki": 1024, "mi": 1024**2, "gi": 1024**3, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
    return int(number) * scale[unit.lower()]


def redis_options(args: list[str]) -> dict[str, str]:
    """``--name value`` pairs of a redis-server command line (the last of a repeated option wins, as in redis)."""
    return {a[2:]: v for a, v in zip(args, args[1:]) if a.startswith("--")}


def test_redis_caps_its_memory_below_its_limit_and_never_evicts():
    """noeviction: running requests' records carry no TTL (allkeys-* would drop them) and the keys with one are the
    replicas' leases (volatile-* would evict a live decoder's, and another replica would fail its requests)."""
    (redis,) = containers(pod_templates(render(K8S / "colocated"))["encdec-redis"])
    options = redis_options(redis["args"])
    assert options["maxmemory-policy"] == "noeviction"
    limit = memory_bytes(redis["resources"]["limits"]["memory"])
    assert 0 < memory_bytes(options["maxmemory"]) <= 0.8 * limit  # room for Redis's own buffers under the limit


# ---- secrets ----------------------------------------------------------------------------------------------
def test_secrets_are_referenced_never_inline():
    readme = (K8S / "README.md").read_text()
    generated = set(re.findall(r"--from-literal=([a-z-]+)=", readme))
    used = set()
    for name in PLACEMENTS:
        docs = render(K8S / name)
        assert not of_kind(docs, "Secret") and not of_kind(docs, "ConfigMap"), name
        text = yaml.safe_dump_all(docs)
        assert not re.search(r"\b[0-9a-f]{32,}\b", text), f"{name}: a literal that looks like a generated secret"
        for deployment, pod in pod_templates(docs).items():
            volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
            for c in containers(pod):
                mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}
                for var in c.get("env", []):
                    where = f"{name}/{deployment}/{c['name']} {var['name']}"
                    if "valueFrom" in var and "secretKeyRef" in var["valueFrom"]:
                        ref = var["valueFrom"]["secretKeyRef"]
                        assert ref["name"] == SECRET, where
                        used.add(ref["key"])
                    elif re.search(r"TOKEN|PASSWORD|API_KEY|SECRET|AUTH", var["name"]):
                        assert var["name"].endswith("_FILE"), f"{where}: a secret as a literal value"
                        directory, _, key = var["value"].rpartition("/")
                        secret = mounts[directory]["secret"]
                        assert secret["secretName"] == SECRET and key in {i["path"] for i in secret["items"]}, where
                        used |= {i["key"] for i in secret["items"] if i["path"] == key}
    assert used == generated == {"redis-password", "auth-token", "internal-token"}


# ---- the placements -----------------------------------------------------------------------------------------
def test_colocated_pods_share_an_in_memory_dev_shm_and_their_own_encoder():
    for name, transport in (("colocated", "shm"), ("gpu", "cuda_ipc")):
        pod = pod_templates(render(K8S / name))["encdec-decoder"]
        by_role = {command(c): c for c in containers(pod) if command(c)}
        encoder, decoder = by_role["serve-encoder"], by_role["serve-decoder"]
        assert encoder.get("restartPolicy") == "Always", name  # a native sidecar: stopped after the decoder
        shm = {v["name"] for v in pod["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
        for c in (encoder, decoder):
            assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in c["volumeMounts"]), (name, c["name"])
        dec, enc = settings(decoder), settings(encoder)
        assert dec.encoder_address == f"127.0.0.1:{enc.port}" and dec.kv_transport == transport, name
        assert transport in enc.kv_transport.split(","), name
    gpu = pod_templates(render(K8S / "gpu"))["encdec-decoder"]
    assert gpu["spec"]["shareProcessNamespace"] is True  # CUDA IPC needs the PID namespace too
    claim = gpu["spec"]["resourceClaims"][0]["name"]
    assert all(c["resources"]["claims"] == [{"name": claim}] for c in containers(gpu))  # ONE GPU for both
    assert all(c["image"].endswith(":cuda") for c in containers(gpu))


@pytest.mark.parametrize("name", SPLIT)
def test_split_decoders_find_encoders_in_the_registry_and_receive_kv_over_torch_dist(name, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets attention_backend=triton (gpu-split/) validate without a GPU
    pods = pod_templates(render(K8S / name))
    (decoder,) = containers(pods["encdec-decoder"])
    (encoder,) = containers(pods["encdec-encoder"])
    dec, enc = settings(decoder), settings(encoder)
    assert dec.encoder_address == "registry" and dec.kv_transport == "torch_dist"
    assert "torch_dist" in enc.kv_transport.split(",")
    assert int(dec.kv_dist_address.rpartition(":")[2]) in container_ports(pods["encdec-decoder"]).values()
    for c, config in ((decoder, dec), (encoder, enc)):
        assert config.redis_url and config.redis_password_file, c["name"]
        assert config.advertise_address == f"{POD_IP}:{config.port}", c["name"]
    assert dec.kv_dist_backend == enc.kv_dist_backend, name  # one torch_dist backend on both ends


def test_gpu_split_gives_each_container_its_own_gpu_and_sends_kv_over_nccl(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets attention_backend=triton validate without a GPU
    docs = render(K8S / "gpu-split")
    roles = set()
    for deployment, pod, c in encdec_containers(docs):
        if deployment not in ("encdec-encoder", "encdec-decoder"):
            continue  # base/'s embed and gateway Deployments stay on the CPU
        where = f"{deployment}/{c['name']}"
        roles.add(command(c))
        # The device plugin's whole GPU per container (NCCL refuses two ranks on one GPU); no DRA claim here.
        assert str(c["resources"]["limits"].get("nvidia.com/gpu")) == "1", where
        assert "claims" not in c["resources"] and "resourceClaims" not in pod["spec"], where
        assert c["image"].endswith(":cuda"), where
        config = settings(c)
        assert config.device == "cuda" and config.kv_device == "cuda", where
        assert config.kv_transport.split(",") == ["torch_dist"], where
        assert config.kv_dist_backend == "nccl", where
    assert roles == {"serve-encoder", "serve-decoder"}


# ---- compose.yaml ------------------------------------------------------------------------------------------
def test_compose_redis_requires_a_password_and_publishes_no_internal_port():
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = doc["services"]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--requirepass" in redis_cmd or "redis.conf" in redis_cmd, redis_cmd
    for name, svc in services.items():
        published = {int(str(p).rpartition(":")[2]) for p in svc.get("ports", [])}
        assert not published & set(INTERNAL_PORTS), (name, published)
        env = svc.get("environment", {})
        if name == "redis":
            options = redis_options(svc["command"])
            assert options["maxmemory-policy"] == "noeviction" and options["maxmemory"], options
        if "ENCDEC_REDIS_URL" in env:
            assert "@" not in env["ENCDEC_REDIS_URL"], name  # no password in the URL itself
            assert env.get("ENCDEC_REDIS_PASSWORD_FILE"), name
