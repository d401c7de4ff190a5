"""``encdec bench``: side-by-side benchmarks printed as Markdown tables."""
