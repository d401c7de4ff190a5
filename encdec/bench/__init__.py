"""``encdec bench``: side-by-side benchmarks printed as Markdown tables."""

ORDER = ["whisper", "seq2seq", "embed", "transfer", "online", "http", "quality", "realtime"]
"""The benches, in the order ``encdec bench all`` runs them (``encdec.bench.suite``)."""
