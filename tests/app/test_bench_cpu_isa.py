"""``encdec bench <any> --cpu-isa avx2`` (encdec/bench/cpu_isa.py): the bench re-runs itself with every library's
cap in its environment, which the systems it starts inherit, and its machine line says the cap."""

from __future__ import annotations

import os
import sys

import pytest

from encdec import cli
from encdec.bench import cpu_isa, machine
from encdec.launcher import Services
from encdec.parser import build_parser
from kernels._clib import isa_cap_environment

CAP = {
    "ENCDEC_MAX_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "CT2_FORCE_CPU_ISA": "AVX2",
}


class Execed(Exception):
    pass


def test_cap_environment_names_every_library():
    assert isa_cap_environment("avx2") == CAP
    assert isa_cap_environment("avx512")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    with pytest.raises(ValueError, match="one of avx2, avx512"):
        isa_cap_environment("sse4")


def test_capped_environ_adds_the_cap_once():
    env = cpu_isa.capped_environ("avx2", {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx512"})
    assert env == {"PATH": "/bin", **CAP}  # the option wins over a variable already set
    assert cpu_isa.capped_environ("avx2", env) is None  # the re-executed process goes on


def test_every_bench_takes_the_option():
    parser = build_parser()
    for bench in ("all", "whisper", "seq2seq", "embed", "online", "http", "quality", "realtime", "transfer"):
        assert parser.parse_args(["bench", bench, "--cpu-isa", "avx2"]).cpu_isa == "avx2"


def test_bench_reexecutes_itself_with_the_cap(monkeypatch):
    for name in CAP:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: {"avx2", "fma"})
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise Execed

    monkeypatch.setattr(os, "execve", execve)
    argv = ["bench", "seq2seq", "--requests", "2", "--cpu-isa", "avx2"]
    with pytest.raises(Execed):
        cli.main(argv)
    [(path, new_argv, env)] = calls
    assert path == sys.executable and new_argv == [sys.executable, "-m", "encdec.cli", *argv]
    assert all(env[name] == value for name, value in CAP.items())


def test_a_cap_the_cpu_lacks_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    assert cli.main(["bench", "seq2seq", "--cpu-isa", "avx512"]) == 2
    assert "this CPU lacks avx512f" in capsys.readouterr().err


def test_started_services_inherit_the_cap(monkeypatch):
    for name, value in CAP.items():
        monkeypatch.setenv(name, value)
    services = Services(redis_url="redis://127.0.0.1:1")
    decoder_env = services._child_env("decoder")  # its own variables on top of ours
    assert all(decoder_env[name] == value for name, value in CAP.items())
    assert services._child_env("encoder") is None  # None: Popen passes this process's environment, cap included


def test_machine_line_says_the_cap(monkeypatch):
    monkeypatch.delenv("ENCDEC_MAX_CPU_ISA", raising=False)
    native = machine.machine_info()
    assert native["isa_cap"] == "" and "capped" not in machine.machine_line(native)
    monkeypatch.setenv("ENCDEC_MAX_CPU_ISA", "avx2")
    info = machine.machine_info()
    assert info["isa_cap"] == "avx2"
    assert f"{info['isa']}, capped to AVX2" in machine.machine_line(info)
