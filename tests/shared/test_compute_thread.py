"""shared.compute_thread: the main thread runs torch on one thread, the compute thread on the configured count."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, threading
from shared.compute_thread import short_omp_spin, single_threaded_main, use_threads
short_omp_spin()
assert os.environ["GOMP_SPINCOUNT"] == "3000"
import torch
n = single_threaded_main(3)
assert n == 3 and torch.get_num_threads() == 1, (n, torch.get_num_threads())
seen = []
t = threading.Thread(target=lambda: (use_threads(n), seen.append(torch.get_num_threads())))
t.start(); t.join()
assert seen == [3], seen
assert torch.get_num_threads() == 1  # OpenMP's count is per thread: the main thread keeps 1
try:
    short_omp_spin()
except RuntimeError:
    print("ok")
"""


def test_main_single_threaded_compute_thread_configured():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_default_count_is_torch_default():
    script = (
        "import torch; d = torch.get_num_threads(); from shared.compute_thread import single_threaded_main; "
        "assert single_threaded_main(0) == d and torch.get_num_threads() == 1; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_user_setting_wins():
    script = "import os; from shared.compute_thread import short_omp_spin; short_omp_spin(); print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    env.pop("GOMP_SPINCOUNT", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "None", out.stderr
