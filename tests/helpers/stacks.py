"""The service stacks tests share: ``stack`` builds one (Redis + encoder + decoder, no Prometheus ports, so other
modules' stacks may run beside it); tests/conftest.py starts the session's tiny.en stack with it."""

from __future__ import annotations

from encdec.launcher import Services

BASE, TINY = "whisper-base", "whisper-tiny.en"
TINY_ENCODE_TIMEOUT_S = 10  # tiny.en's session stack: a window whose encoder is gone fails within this


def stack(model: str, redis_url: str, log_dir, decoder_args: tuple[str, ...] = ()) -> Services:
    """A Services stack of ``model`` to start with ``with``."""
    no_metrics = ["--metrics-port", "0"]
    return Services(
        model=model,
        redis_url=redis_url,
        log_dir=str(log_dir),
        extra_encoder_args=no_metrics,
        extra_decoder_args=[*no_metrics, *decoder_args],
    )
