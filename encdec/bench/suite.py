"""``encdec bench`` / ``encdec bench all``: every bench in one invocation.

Runs peak (the machine's limit and the decode-step products against it), whisper, seq2seq, embed, transfer (when ``encdec/bench/transfer.py``
exists), online, http (when httpx, its client, is installed), quality and realtime one
after another, each exactly as its own sub-command would with its defaults (the CLI
parser builds each one's arguments, plus ``--threads`` / ``--skip-ct2`` and any
``--<bench>-args``), collects each bench's JSON, then prints every Markdown
table (with its ratio column; a bench's further ``tables`` and ``notes``
lines under it), and writes the combined JSON (``--json``) and a
PNG (``--plot``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from encdec.bench import ORDER
from encdec.bench.machine import machine_info, machine_line
from encdec.bench.table import markdown_table, write_json
from encdec.parser import build_parser

# Benches that take --threads / --skip-ct2.
THREADED = {"peak", "whisper", "seq2seq", "embed", "transfer", "online", "http", "quality", "realtime"}
CT2 = {"whisper", "seq2seq", "quality", "realtime"}


def available() -> list[str]:
    """The benches this checkout can run (transfer only when its module exists, http only with httpx)."""
    has = {
        "transfer": importlib.util.find_spec("encdec.bench.transfer") is not None,
        "http": importlib.util.find_spec("httpx") is not None,
    }
    return [b for b in ORDER if has.get(b, True)]


def _columns(name: str, payload: dict) -> list[str]:
    if payload.get("columns"):
        return list(payload["columns"])
    try:
        return list(importlib.import_module(f"encdec.bench.{name}").COLUMNS)
    except (ImportError, AttributeError):
        return list(payload["rows"][0]) if payload.get("rows") else []


def _bench_args(name: str, args, json_path: str) -> object:
    argv = ["bench", name, "--json", json_path]
    if name in THREADED:
        argv += ["--threads", str(args.threads)]
    if name in CT2 and args.skip_ct2:
        argv.append("--skip-ct2")
    argv += shlex.split(getattr(args, f"{name}_args") or "")
    return build_parser().parse_args(argv)


def run(args) -> dict:
    """Runs the selected benches; returns ``{"benches": {name: payload}, "failed": {name: error}, ...}``."""
    from tqdm import tqdm

    names = [n.strip() for n in (args.only.split(",") if args.only else available()) if n.strip()]
    skip = {n.strip() for n in args.skip.split(",") if n.strip()}
    unknown = [n for n in names + sorted(skip) if n not in ORDER]
    if unknown:
        raise ValueError(f"unknown bench(es) {unknown}; choose from {', '.join(ORDER)}")
    if "transfer" in names and "transfer" not in available():
        raise ValueError("the transfer bench is not in this checkout (encdec/bench/transfer.py)")
    if "http" in names and "http" not in available():
        raise ValueError("the http bench needs httpx (pip install httpx)")
    names = [n for n in ORDER if n in names and n not in skip]
    benches: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="encdec-bench-") as tmp:
        bar = tqdm(names, desc="encdec bench", unit="bench")
        for name in bar:
            bar.set_postfix_str(name)
            path = os.path.join(tmp, f"{name}.json")
            start = time.perf_counter()
            try:
                sub = _bench_args(name, args, path)
                with contextlib.redirect_stdout(sys.stderr):  # stdout gets only the combined tables at the end
                    code = sub.func(sub)
                payload = json.loads(Path(path).read_text()) if Path(path).is_file() else None
                if payload is None:
                    raise RuntimeError(f"exit code {code}, no JSON written")
            except Exception as exc:  # noqa: BLE001 - one failing bench must not lose the others' results
                failed[name] = f"{type(exc).__name__}: {exc}"
                print(f"[bench {name}] failed: {failed[name]}", file=sys.stderr, flush=True)
                continue
            payload["wall_s"] = time.perf_counter() - start
            payload["loadavg_after"] = os.getloadavg()  # the machine's 1/5/15-min load: how noisy the run was
            payload.setdefault("columns", _columns(name, payload))
            benches[name] = payload
    return {
        "suite": names,
        "machine": machine_info(),
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "benches": benches,
        "failed": failed,
    }


def render(result: dict) -> str:
    """The machine, then every bench's Markdown table under a heading (and its ``tables``: ``[{"title",
    "columns", "rows"}]``, and ``notes`` lines, when it has them)."""
    parts = [f"Machine: {machine_line(result['machine'])}\n"]
    for name, payload in result["benches"].items():
        parts.append(f"### {name}\n\n{markdown_table(payload.get('rows', []), payload['columns'])}\n")
        for table in payload.get("tables", []):
            parts.append(f"{table['title']}:\n\n{markdown_table(table['rows'], table['columns'])}\n")
        if payload.get("notes"):
            parts.append("\n".join(payload["notes"]) + "\n")
    for name, error in result["failed"].items():
        parts.append(f"### {name}\n\nfailed: {error}\n")
    return "\n".join(parts)


def main(args) -> int:
    result = run(args)
    print(render(result))
    if args.json:
        write_json(args.json, result)
    if args.plot and result["benches"]:
        from encdec.bench.plot import plot_results

        print(f"plot: {plot_results(result['benches'], args.plot)}", file=sys.stderr)
    return 1 if result["failed"] else 0
