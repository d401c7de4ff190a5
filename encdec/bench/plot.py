"""PNG plot of bench results (matplotlib, the ``bench`` extra): one panel per bench.

Throughput benches (whisper, seq2seq, embed, transfer) get horizontal bars of
their rate column per row (system / mode / model); online gets its TTFT and
TPOT p50 / p99 bars per workload.
"""

from __future__ import annotations

from pathlib import Path

from encdec.bench.table import format_number

# The bar each bench plots, in order of preference (the first present in the rows).
METRICS = {
    "whisper": ["tokens/s"],
    "seq2seq": ["tokens/s"],
    "embed": ["sentences/s"],
    "transfer": ["GB/s"],
    "http": ["HTTP / gRPC"],  # its rows mix req/s and sentences/s: the ratio is what compares
}
ONLINE_METRICS = ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
LABEL_KEYS = ("model", "workload", "payload", "system", "mode", "batch", "transport")


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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
