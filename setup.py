"""Build hooks for encdec-serve: generate the protobuf/gRPC modules at build time.

All metadata lives in pyproject.toml. This file only adds a ``build_py`` that
compiles ``proto/encdec/v1/*.proto`` into ``shared/proto/{name}_pb2.py``,
``{name}_pb2.pyi`` and ``{name}_pb2_grpc.py`` before the normal build (it also
runs for ``pip install -e .``, where the files land in the source tree), an
``sdist`` that ships the .proto sources, and, on x86-64 Linux, the C library of
``kernels/packed_linear.py``, ``kernels/cpu_paged_attention.py`` and
``kernels/cpu_argmax.py`` (``kernels/_cpu_kernels*.so``: plain C loaded with
ctypes, no Python API, one worker pool for all). It is optional: without a C
compiler the install still succeeds and the torch code paths run instead.

Why the temporary include root: grpc's generated ``*_pb2_grpc.py`` imports its
``*_pb2`` by the .proto's path relative to the include root. Copying the .proto
files to ``<tmp>/shared/proto/`` and compiling with ``<tmp>`` as the root makes
that import ``from shared.proto import decoder_pb2``, with no edits to
generated code.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.sdist import sdist as _sdist

ROOT = os.path.dirname(os.path.abspath(__file__))
PROTO_SRC_DIR = os.path.join("proto", "encdec", "v1")
PROTO_PKG_DIR = os.path.join("shared", "proto")  # where generated modules go


def generate_protos(root: str = ROOT) -> list[str]:
    """Compiles ``proto/encdec/v1/*.proto`` into ``shared/proto/``.

    Returns:
        The generated file paths, relative to ``root``. Empty if the .proto
        sources are absent (e.g. building from an sdist that already holds the
        generated modules).

    Raises:
        RuntimeError: protoc reported an error.
    """
    protos = sorted(glob.glob(os.path.join(root, PROTO_SRC_DIR, "*.proto")))
    if not protos:
        return []
    # Imported lazily: only the build environment has grpcio-tools.
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    out_dir = os.path.join(root, PROTO_PKG_DIR)
    os.makedirs(out_dir, exist_ok=True)
    generated: list[str] = []
    with tempfile.TemporaryDirectory(prefix="encdec-proto-") as tmp:
        inc_pkg = os.path.join(tmp, PROTO_PKG_DIR)
        os.makedirs(inc_pkg)
        rel_protos = []
        for src in protos:
            shutil.copy2(src, inc_pkg)
            rel_protos.append(os.path.join(PROTO_PKG_DIR, os.path.basename(src)))
        args = [
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{well_known}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            *[os.path.join(tmp, p) for p in rel_protos],
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed (exit {rc}) on {', '.join(rel_protos)}")
    for p in rel_protos:
        stem = p[: -len(".proto")]
        generated += [stem + "_pb2.py", stem + "_pb2.pyi", stem + "_pb2_grpc.py"]
    return generated


class build_py(_build_py):
    """Generates the protobuf/gRPC modules, then builds as usual."""

    def run(self) -> None:
        files = generate_protos()
        if files:
            print("encdec-serve: generated " + ", ".join(files))
        super().run()


class sdist(_sdist):
    """Also ships proto/encdec/v1/*.proto (outside any package)."""

    def make_release_tree(self, base_dir, files):
        protos = sorted(glob.glob(os.path.join(PROTO_SRC_DIR, "*.proto")))
        super().make_release_tree(base_dir, list(files) + protos)


def c_kernels() -> list[Extension]:
    """The optional C kernels: x86-64 Linux only (AVX2/FMA code is chosen per function, checked at run time)."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    sources = [
        f"kernels/csrc/{name}.c"
        for name in ("packed_linear", "paged_decode_attention", "decode_layer", "argmax", "row_norm", "parallel")
    ]
    return [
        Extension(
            "kernels._cpu_kernels",
            sources,
            depends=["kernels/csrc/parallel.h", "kernels/csrc/simd_math.h"],
            extra_compile_args=["-O3", "-std=gnu11"],
            libraries=["pthread", "m"],
            optional=True,
        )
    ]


setup(cmdclass={"build_py": build_py, "sdist": sdist}, ext_modules=c_kernels())
