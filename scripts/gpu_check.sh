#!/usr/bin/env bash
# GPU check of the CUDA cross-KV transports (issue 5), on a machine with one CUDA GPU:
#   1. tests/shared/test_kv_transport_cuda.py without NCCL: cuda_ipc with encoder and decoder as two
#      processes on the one device (bit-exact blocks, non-contiguous ids, encoder lengths that do
#      not divide the block size, restarted decoder, malformed targets);
#   2. the same file's NCCL test (torch_dist, two processes on the one device), run apart so that
#      an NCCL failure which takes its process down cannot cost the cuda_ipc results;
#   3. the transfer bench (`encdec bench transfer`): GB/s of every transport next to memcpy;
#   then one summary table of all three;
#   4. scripts/gpu_model_check.py: Whisper and T5 engines on the GPU (torch and triton attention)
#      against the CPU engine / HF, with its own table; it gets what is left of the 5 minutes.
# Prints "skipped: no CUDA GPU" and exits 0 where torch sees no CUDA device.
# Exit status: 0 when every test passed (or skipped with a reason) and every bench row ran
# bit-exact (or is marked unsupported), else 1. Under 5 minutes: each step has a timeout
# (90 + 60 + 140 s); a healthy run takes a fraction of that.
#
# Runs as is on a bare GPU machine: it needs only python3 with torch, pytest and grpcio, run
# from anywhere inside the repository. Nothing it imports needs the project venv, Redis or
# the generated gRPC code.
# Env: PYTHON          interpreter (default python3)
#      GPU_CHECK_OUT   folder for logs, junit XML and the bench JSON (default: a new temp folder)
#      NCCL_MULTI_RANK_GPU_ENABLE  default 1: NCCL >= 2.30 then allows two ranks on one GPU
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

if ! why="$("$PY" -c 'import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; print(f"torch {torch.__version__} sees {n} CUDA devices"); raise SystemExit(0 if n else 1)' 2>&1)"; then
  echo "skipped: no CUDA GPU (${why##*$'\n'})"
  exit 0
fi

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NCCL_MULTI_RANK_GPU_ENABLE="${NCCL_MULTI_RANK_GPU_ENABLE:-1}"
OUT="${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$OUT"
echo "gpu_check: $why; logs in $OUT"
"$PY" -c '
import torch
props = torch.cuda.get_device_properties(0)
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
print(f"gpu_check: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, NCCL {nccl}")'

start=$SECONDS
echo "== 1/3 cuda_ipc transfer tests: encoder and decoder as two processes on one GPU"
timeout -k 10 90 "$PY" -m pytest -q -p no:cacheprovider -rs -o timeout=60 -k "not nccl" \
  --junitxml "$OUT/tests_cuda_ipc.xml" tests/shared/test_kv_transport_cuda.py 2>&1 | tee "$OUT/tests_cuda_ipc.log"
ipc_rc=${PIPESTATUS[0]}

echo "== 2/3 NCCL transfer test: torch_dist, two processes on one GPU"
timeout -k 10 60 "$PY" -m pytest -q -p no:cacheprovider -rs -o timeout=50 -k nccl \
  --junitxml "$OUT/tests_nccl.xml" tests/shared/test_kv_transport_cuda.py 2>&1 | tee "$OUT/tests_nccl.log"
nccl_rc=${PIPESTATUS[0]}

echo "== 3/3 transfer bench: every transport available here"
timeout -k 10 140 "$PY" -m encdec.bench.transfer --iters 10 --warmup 2 --json "$OUT/transfer.json" \
  2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== 4/4 models on the GPU: scripts/gpu_model_check.py"
models_s=$(( 285 - (SECONDS - start) )); (( models_s > 180 )) && models_s=180
if (( models_s >= 30 )); then
  timeout -k 5 "$models_s" "$PY" scripts/gpu_model_check.py 2>&1 | tee "$OUT/models.log"
  models_rc=${PIPESTATUS[0]}
else
  echo "not run: only ${models_s} s of the 5 minutes left"; models_rc=1
fi

echo "== summary ($((SECONDS - start)) s; exit codes: cuda_ipc tests $ipc_rc, NCCL test $nccl_rc, bench $bench_rc, models $models_rc)"
"$PY" - "$OUT" <<'PYTHON'
import json, os, re, sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
rows = []
for part in ("cuda_ipc", "nccl"):
    path = f"{out}/tests_{part}.xml"
    if not os.path.exists(path):
        rows.append((f"{part} tests", "tests/shared/test_kv_transport_cuda.py", "FAILED (no report: crashed or timed out)", "", "", ""))
        continue
    groups = {}  # test function -> (verdict of each case, detail to show)
    for case in ET.parse(path).iter("testcase"):
        verdict, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                verdict = "skipped" if kind == "skipped" else "FAILED"
                detail = " ".join((node.get("message") or "").split()).replace("|", "/")[:120]
        verdicts, shown = groups.setdefault(re.sub(r"\[.*\]$", "", case.get("name")), ([], []))
        verdicts.append(verdict)
        if detail and (verdict == "FAILED" or not shown):
            shown[:] = [detail]
    for name, (verdicts, shown) in groups.items():
        counts = ", ".join(f"{verdicts.count(v)} {v}" for v in ("passed", "FAILED", "skipped") if verdicts.count(v))
        rows.append((f"{part} tests", name, counts, "", "", shown[0] if shown else ""))
if os.path.exists(f"{out}/transfer.json"):
    for r in json.load(open(f"{out}/transfer.json"))["rows"]:
        note = str(r.get("note") or "")
        unsupported = note.startswith(("unsupported", "not run: unsupported"))  # later payloads of an unsupported transport
        verdict = "bit-exact" if r.get("bit-exact") == "yes" else ("unsupported" if unsupported else "FAILED")
        gbps = f"{r['GB/s']:.2f}" if r.get("GB/s") else ""
        ratio = f"{r['x memcpy']:.2f}" if r.get("x memcpy") else ""
        memcpy = f"memcpy {r['memcpy GB/s']:.1f} GB/s" if r.get("memcpy GB/s") else ""
        rows.append((f"bench {r['payload']} ({r['MB']:.1f} MB)", f"{r['transport']} [{r['device']}]", verdict, gbps, ratio,
                     (note or memcpy).replace("|", "/")[:120]))
else:
    rows.append(("bench", "encdec.bench.transfer", "FAILED (no JSON: crashed or timed out)", "", "", ""))
print("| check | case | result | GB/s | x memcpy | detail |")
print("|---|---|---|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
PYTHON

if [[ $ipc_rc -eq 0 && $nccl_rc -eq 0 && $bench_rc -eq 0 && $models_rc -eq 0 ]]; then
  echo "gpu_check: OK"
  exit 0
fi
echo "gpu_check: FAILED (logs in $OUT)"
exit 1
