"""Reads compose.yaml as ``docker compose`` does, and refuses what it does not understand.

``load_project`` applies YAML anchors and merge keys, ``${VAR}`` /
``${VAR:-default}`` / ``${VAR-default}`` / ``$$`` interpolation from the
``.env`` beside the file, and the profiles its ``COMPOSE_PROFILES`` selects.
``check_understood`` raises ``UnsupportedCompose`` on any key or value form the
local run (``compose_local``) does not translate, so the wiring test fails
rather than silently skipping part of the deployment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml


class UnsupportedCompose(ValueError):
    """compose.yaml uses a key or value form this translator does not understand."""


SERVICE_KEYS = {
    "image",
    "build",
    "command",
    "environment",
    "expose",
    "ports",
    "networks",
    "volumes",
    "depends_on",
    "healthcheck",
    "profiles",
    "ipc",
    "pid",
    "shm_size",
    "deploy",
    "stop_grace_period",
    "read_only",
    "tmpfs",
}
DEFAULT_STOP_GRACE_PERIOD_S = 10.0  # compose's: SIGKILL this long after SIGTERM
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period"}
CONDITIONS = {"service_healthy", "service_started", "service_completed_successfully"}


@dataclass
class Project:
    """compose.yaml after anchors and interpolation; ``profiles`` are the active ones."""

    services: dict[str, dict]
    networks: dict[str, dict]
    volumes: dict[str, dict]
    profiles: set[str]

    def active(self) -> dict[str, dict]:
        """Services ``docker compose up`` starts: no profiles, or one of the active ones."""
        return {n: s for n, s in self.services.items() if not s.get("profiles") or self.profiles & set(s["profiles"])}


# ---- loading -------------------------------------------------------------------------------------
def read_dotenv(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a compose ``.env`` file (``#`` comments, optional quotes)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise UnsupportedCompose(f"{path}: not KEY=VALUE: {line!r}")
        values[key.strip()] = value.strip().strip("'\"")
    return values


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-)(?P<default>[^}]*))?\}|(?P<other>.))"
)


def interpolate(value, variables: dict[str, str]):
    """Compose variable substitution on every string in ``value``.

    Raises:
        UnsupportedCompose: a form other than ``$$``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``.
    """
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        if m["other"] is not None or m["name"] is None:
            raise UnsupportedCompose(f"unsupported variable syntax in {value!r}")
        got = variables.get(m["name"])
        if m["op"] == ":-" and not got:
            return m["default"]
        if m["op"] == "-" and got is None:
            return m["default"]
        return got or ""

    return _VAR.sub(sub, value)


def load_project(path: Path) -> Project:
    """Reads ``path`` and the ``.env`` beside it; the committed defaults, not this shell's variables,
    drive interpolation and profiles, so the test checks what the repository ships."""
    dotenv = read_dotenv(path.parent / ".env")
    doc = interpolate(yaml.safe_load(path.read_text()), dotenv)
    unknown = {k for k in doc if not k.startswith("x-")} - {"services", "networks", "volumes"}
    if unknown:
        raise UnsupportedCompose(f"top-level keys not understood: {sorted(unknown)}")
    profiles = {p.strip() for p in dotenv.get("COMPOSE_PROFILES", "").split(",") if p.strip()}
    return Project(
        doc["services"],
        doc.get("networks") or {},
        {k: v or {} for k, v in (doc.get("volumes") or {}).items()},
        profiles,
    )


# ---- what the translator understands ---------------------------------------------------------------
def parse_duration(text: str) -> float:
    """Compose duration (``1m30s``, ``5s``, ``250ms``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise UnsupportedCompose(f"duration not understood: {text!r}")
    return sum(float(n) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def exposed_ports(service: dict) -> list[int]:
    return [int(p) for p in service.get("expose", [])]


def published_ports(service: dict) -> list[tuple[int, int]]:
    """``(host port, container port)`` of each short-syntax ``[IP:]HOST:CONTAINER`` entry."""
    return [(host, container) for _, host, container in published_binds(service)]


def published_binds(service: dict) -> list[tuple[str, int, int]]:
    """``(host IP, host port, container port)`` of each short-syntax ``[IP:]HOST:CONTAINER`` entry (IP
    ``0.0.0.0``, every interface, when the entry names none)."""
    out = []
    for entry in service.get("ports", []):
        m = re.fullmatch(r"(?:(\d{1,3}(?:\.\d{1,3}){3}):)?(\d+):(\d+)", str(entry))
        if not m:
            raise UnsupportedCompose(f'ports entry not understood (use "[IP:]HOST:CONTAINER"): {entry!r}')
        out.append((m[1] or "0.0.0.0", int(m[2]), int(m[3])))
    return out


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UnsupportedCompose(message)


def check_understood(project: Project) -> None:
    """Raises UnsupportedCompose on any key or value form outside what this module translates."""
    for net, spec in project.networks.items():
        require(set(spec or {}) <= {"internal"}, f"network {net}: keys not understood: {sorted(spec)}")
    for vol, spec in project.volumes.items():
        require(not spec, f"volume {vol}: options not understood: {spec}")
    for name, svc in project.services.items():
        where = f"service {name}"
        require(set(svc) <= SERVICE_KEYS, f"{where}: keys not understood: {sorted(set(svc) - SERVICE_KEYS)}")
        require(
            "build" in svc or str(svc.get("image", "")).startswith("redis:"),
            f"{where}: only built services and the redis image run here",
        )
        if "build" in svc:
            require(
                set(svc["build"]) <= {"context", "args"} and svc["build"].get("context") == ".",
                f"{where}: build must be {{context: ., args}}",
            )
        cmd = svc.get("command")
        require(
            isinstance(cmd, list) and all(isinstance(a, str) for a in cmd),
            f"{where}: command must be a list of strings",
        )
        env = svc.get("environment", {})
        require(isinstance(env, dict), f"{where}: environment must be a mapping")
        for key, value in env.items():
            require(
                isinstance(value, (str, int, float)) and not isinstance(value, bool),
                f"{where}: {key} must be a string or number",
            )
        for port in svc.get("expose", []):
            require(str(port).isdigit(), f"{where}: expose entry {port!r}")
        for _, container in published_ports(svc):
            require(container in exposed_ports(svc), f"{where}: publishes {container}, which it does not expose")
        for net in svc.get("networks", []):
            require(isinstance(net, str) and net in project.networks, f"{where}: network {net!r} not declared")
        for mount in svc.get("volumes", []):
            vol, _, target = str(mount).partition(":")
            require(
                vol in project.volumes and target.startswith("/"),
                f"{where}: only NAMED_VOLUME:/path mounts, got {mount!r}",
            )
        deps = svc.get("depends_on", {})
        require(isinstance(deps, dict), f"{where}: depends_on must be a mapping with conditions")
        for dep, spec in deps.items():
            require(
                dep in project.services and set(spec) == {"condition"} and spec["condition"] in CONDITIONS,
                f"{where}: depends_on {dep}: {spec}",
            )
        hc = svc.get("healthcheck")
        if hc is not None:
            require(
                set(hc) <= HEALTHCHECK_KEYS and hc["test"][0] == "CMD",
                f"{where}: healthcheck must be a CMD list with {sorted(HEALTHCHECK_KEYS)}",
            )
            for k in ("interval", "timeout", "start_period"):
                parse_duration(hc.get(k, "0s"))
        require(svc.get("read_only", True) is True, f"{where}: read_only must be true or absent")  # no local effect
        for mount in svc.get("tmpfs", []):  # PATH[:mount options]; no local effect (the processes write where they run)
            require(isinstance(mount, str) and mount.startswith("/"), f"{where}: tmpfs entry {mount!r}")
        for key, own_mode in (("ipc", "shareable"), ("pid", None)):  # namespace sharing: no local effect
            mode = svc.get(key)
            joined = mode.removeprefix("service:") if isinstance(mode, str) and mode.startswith("service:") else None
            require(mode in (None, own_mode) or joined in project.services, f"{where}: {key} {mode!r} not understood")
        if "deploy" in svc:
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            require(
                svc["deploy"] == {"resources": {"reservations": {"devices": devices}}},
                f"{where}: deploy beyond device reservations",
            )
            require(
                all(set(d) <= {"driver", "count", "capabilities"} for d in devices), f"{where}: device reservation keys"
            )
