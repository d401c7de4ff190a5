"""encdec: the application around the services.

The ``encdec`` CLI, the process launcher, the gRPC client, the local Redis
starter and the benchmarks. No service imports this package.
"""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
"""The bundled speech clips (16 kHz mono WAV; ``data/README.md`` says how they were made)."""
