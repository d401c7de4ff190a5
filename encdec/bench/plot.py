"""PNG plot of bench results (matplotlib, the ``bench`` extra): one panel per bench.

Throughput benches (whisper, seq2seq, embed, transfer) get horizontal bars of
their rate column per row (system / mode / model); online gets its TTFT and
TPOT p50 / p99 bars per workload. ``plot_roofline`` draws ``encdec bench peak``'s
decode-step products under the machine's measured roofs.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from encdec.bench.table import format_number

# The bar each bench plots, in order of preference (the first present in the rows).
METRICS = {
    "peak": ["ours GFLOP/s", "F.linear GFLOP/s"],
    "whisper": ["tokens/s"],
    "seq2seq": ["tokens/s"],
    "embed": ["sentences/s"],
    "transfer": ["GB/s"],
    "http": ["HTTP / gRPC"],  # its rows mix req/s and sentences/s: the ratio is what compares
}
ONLINE_METRICS = ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
LABEL_KEYS = ("model", "workload", "payload", "system", "mode", "batch", "transport")


def save_figure(fig, path: str | Path) -> Path:
    """Lays out ``fig``, writes it to ``path`` (PNG at 100 dpi; parent folders made) and closes it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _metric(name: str, rows: list[dict]) -> str | None:
    for m in METRICS.get(name, []):
        if any(isinstance(r.get(m), (int, float)) for r in rows):
            return m
    for key in rows[0] if rows else []:  # any rate-like numeric column (e.g. the transfer bench's GB/s)
        if "/s" in key and any(isinstance(r.get(key), (int, float)) for r in rows):
            return key
    return None


def _label(row: dict) -> str:
    return " | ".join(str(row[k]) for k in LABEL_KEYS if row.get(k) not in (None, ""))


def plot_results(benches: dict[str, dict], path: str | Path) -> Path:
    """Writes one PNG with a panel per bench payload (``{"rows": [...]}``) and returns its path.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e '.[bench]'``).
        ValueError: no bench has rows to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, p["rows"]) for name, p in benches.items() if p and p.get("rows")]
    if not panels:
        raise ValueError("no bench results to plot")
    heights = [
        max(1.6, 0.32 * len(rows) * (len(ONLINE_METRICS) if name == "online" else 1) + 1.0) for name, rows in panels
    ]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(10, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    for ax, (name, rows) in zip(axes[:, 0], panels):
        if name == "online":
            labels, values = [], []
            for r in rows:
                for m in ONLINE_METRICS:
                    if isinstance(r.get(m), (int, float)):
                        labels.append(f"{r.get('workload', '')} @ {r.get('rate req/s', '')} req/s: {m}")
                        values.append(r[m])
            unit = "ms"
        else:
            metric = _metric(name, rows)
            if metric is None:
                ax.set_axis_off()
                ax.set_title(f"{name}: no numeric rate column")
                continue
            labels = [_label(r) for r in rows if isinstance(r.get(metric), (int, float))]
            values = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
            unit = metric
        ys = range(len(values))
        ax.barh(list(ys), values, color="tab:blue")
        ax.set_yticks(list(ys), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_title(name)
        for y, v in zip(ys, values):
            ax.text(v, y, " " + format_number(v), va="center", fontsize=7)
    return save_figure(fig, path)


def plot_roofline(payloads: list[dict], path: str | Path) -> Path:
    """Writes a roofline PNG, one panel per ``encdec bench peak`` payload (``encdec.bench.products.run`` with its
    ``machine``: e.g. a native run and a ``--cpu-isa avx2`` one), and returns its path.

    Axes: FLOP per byte (``FLOP/byte`` of each product row) against GFLOP/s, both logarithmic. Roofs: the fp32
    sgemm peak (solid; bf16 / int8 peaks, where measured, are named in the title) and memory read bandwidth x
    FLOP/byte (dashed; weights that fit in a cache can sit above it). Points: ``packed_linear`` (filled) and ``F.linear`` (hollow)
    per product, coloured by row count.

    Raises:
        ImportError: matplotlib is not installed (``pip install -e '.[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from encdec.bench.machine import machine_line

    fig, axes = plt.subplots(1, len(payloads), figsize=(7 * len(payloads), 5.8), squeeze=False)
    for ax, payload in zip(axes[0], payloads):
        peak, rows = payload["peak"], payload["rows"]
        xs = [r["FLOP/byte"] for r in rows]
        lo, hi = min(xs) / 2, max(xs) * 2
        ridge = peak["fp32_gflops"] / peak["read_gbs"]
        ax.plot([lo, ridge, hi], [peak["read_gbs"] * lo, peak["fp32_gflops"], peak["fp32_gflops"]], "k-", lw=1.5,
                label=f"fp32 sgemm {format_number(peak['fp32_gflops'])} GFLOP/s, read {format_number(peak['read_gbs'])} GB/s")  # fmt: skip
        ax.plot([lo, hi], [peak["read_gbs"] * lo, peak["read_gbs"] * hi], "k--", lw=0.8)
        others = [f"{name} {format_number(peak[key])}" for key, name in (("bf16_gflops", "bf16"), ("int8_gops", "int8 GOP/s"))
                  if peak.get(key)]  # fmt: skip
        counts = sorted({r["rows"] for r in rows})
        colours = dict(zip(counts, plt.cm.viridis([i / max(len(counts) - 1, 1) for i in range(len(counts))])))
        for r in rows:
            c = colours[r["rows"]]
            if isinstance(r["ours GFLOP/s"], (int, float)):
                ax.plot(r["FLOP/byte"], r["ours GFLOP/s"], "o", color=c, ms=6)
            ax.plot(r["FLOP/byte"], r["F.linear GFLOP/s"], "o", mfc="none", mec=c, ms=6)
        for m, c in colours.items():
            ax.plot([], [], "o", color=c, label=f"{m} rows: packed_linear (filled), F.linear (hollow)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        rates = [v for r in rows for v in (r["ours GFLOP/s"], r["F.linear GFLOP/s"]) if isinstance(v, (int, float))]
        ax.set_ylim(min(rates + [peak["read_gbs"] * lo]) / 2, 2 * max(rates + [peak["fp32_gflops"]]))
        ax.set_xlabel("FLOP per byte (float32 weight, x and output moved once)")
        ax.set_ylabel("GFLOP/s")
        info = payload.get("machine")
        title = textwrap.fill(machine_line(info).split("; ")[0], 80) if info else "this machine"
        above = f"; above the chart: {', '.join(others)}" if others else ""
        ax.set_title(f"{title}\n{payload['threads']} threads: decode-step products{above}", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, which="both", lw=0.3)
    return save_figure(fig, path)
