"""``encdec bench``: side-by-side benchmarks printed as Markdown tables."""

ORDER = ["peak", "whisper", "seq2seq", "embed", "transfer", "online", "http", "quality", "realtime"]
"""The benches, in the order ``encdec bench all`` runs them (``encdec.bench.suite``)."""
