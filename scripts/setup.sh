#!/usr/bin/env bash
# Sets up a development environment in .venv at the repository root.
# Idempotent: safe to re-run; it only creates what is missing and re-installs
# the project (which regenerates shared/proto/*_pb2*.py from proto/).
#
# Needs: python3.11 (or a python3 >= 3.11) and a C compiler.
# Env: TORCH_INDEX_URL  optional package index for torch (e.g. PyTorch's CPU wheel index)
#      EXTRAS           extras to install (default: test; EXTRAS= installs the runtime only)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
TORCH_SPEC="torch==2.13.0"   # pinned: an unpinned torch pulls a multi-GB CUDA build
EXTRAS="${EXTRAS-test}"  # set but empty: no extras
say() { printf '[setup] %s\n' "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  PY=""
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      PY="$(command -v "$cand")"; break
    fi
  done
  [[ -n "$PY" ]] || { echo "[setup] error: need python3.11 (or python3 >= 3.11) on PATH" >&2; exit 1; }
  say "creating $VENV with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
else
  say "reusing $VENV ($("$VENV/bin/python" --version 2>&1))"
fi
"$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' ||
  { echo "[setup] error: $VENV has Python < 3.11; remove it and re-run" >&2; exit 1; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Editable installs of pyproject-only metadata need pip >= 21.3 (PEP 660).
if ! "$VENV/bin/python" -c 'import pip, sys; sys.exit(0 if tuple(map(int, pip.__version__.split(".")[:2])) >= (21, 3) else 1)'; then
  say "upgrading pip (too old for editable installs)"
  "${PIP[@]}" install -q --upgrade pip
fi

have_torch="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "${have_torch%%+*}" == "2.13.0" ]]; then
  say "torch $have_torch already installed"
else
  say "installing $TORCH_SPEC first (CPU wheel where available)"
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    "${PIP[@]}" install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" install -q "$TORCH_SPEC"
  fi
  "$VENV/bin/python" -W ignore -c 'import torch; print("[setup] torch", torch.__version__, "cuda:", torch.version.cuda)'
fi

# The quality corpus (encdec bench quality, and the tests that build recordings from it) speaks with espeak-ng and
# resamples with sox: Debian packages, installed here when missing and this shell may (root with apt-get).
if ! command -v espeak-ng >/dev/null 2>&1 || ! command -v sox >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    say "installing espeak-ng and sox with apt-get (the quality corpus's speech)"
    (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq espeak-ng sox) >/tmp/setup-apt.log 2>&1 ||
      say "apt-get failed (see /tmp/setup-apt.log): tests that build speech recordings will fail"
  else
    say "note: espeak-ng and sox are missing (apt-get install espeak-ng sox): tests that build speech recordings need them"
  fi
fi

say "installing encdec-serve in editable mode with extras [$EXTRAS] (generates shared/proto)"
"${PIP[@]}" install -q -e ".${EXTRAS:+[$EXTRAS]}"

"$VENV/bin/python" - <<'PY'
from shared.proto import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc  # noqa: F401
import torch
print(f"[setup] ok: shared.proto imports; torch {torch.__version__}")
PY
say "done. Activate with: source .venv/bin/activate"
