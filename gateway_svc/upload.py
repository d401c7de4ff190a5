"""The request-body limits: ``--max-upload-mb`` on the upload routes (``/v1/audio/*``), ``--max-request-mb`` on the
JSON routes; 413 before the body is read whole.

A ``Content-Length`` over the limit is answered at once, without reading the body; a body sent without one
(chunked) is counted as it arrives and refused once it passes the limit. Either way the gateway never holds more
than the limit of one request.
"""

from __future__ import annotations

from gateway_svc.errors import TOO_LARGE_KEY, GatewayError

# Multipart framing and the small form fields beside the file (OpenAI's limit is on the file).
FORM_OVERHEAD_BYTES = 64 * 1024


def too_large(limit_bytes: int, audio: bool = True) -> GatewayError:
    """The 413 of a body over ``limit_bytes``: an audio upload's, or a JSON body's."""
    flag, param = ("--max-upload-mb", "file") if audio else ("--max-request-mb", None)
    advice = "send a shorter clip (FLAC is about half the size of WAV)" if audio else "split the request"
    return GatewayError(
        413,
        f"the request body is over this server's limit of {limit_bytes / 1e6:g} MB ({flag}); " + advice,
        param,
        "file_too_large" if audio else "request_too_large",
    )


class UploadLimitMiddleware:
    """ASGI middleware bounding every request body: ``upload_bytes`` (plus ``FORM_OVERHEAD_BYTES``) on paths
    starting with one of ``upload_prefixes``, ``request_bytes`` on the others (JSON bodies)."""

    def __init__(
        self, app, upload_bytes: int, request_bytes: int, upload_prefixes: tuple[str, ...] = ("/v1/audio/",)
    ) -> None:
        self.app = app
        self.upload_bytes = upload_bytes
        self.request_bytes = request_bytes
        self.upload_prefixes = upload_prefixes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        audio = scope["path"].startswith(self.upload_prefixes)
        limit = self.upload_bytes if audio else self.request_bytes
        bound = limit + FORM_OVERHEAD_BYTES if audio else limit
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > bound:
            await too_large(limit, audio).response()(scope, receive, send)
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > bound:
                    err = too_large(limit, audio)
                    # The route's handler answers 413; FastAPI's body parsing turns any exception of the body's
                    # read into its own 400, so the error also waits in the scope for errors.install to find.
                    scope[TOO_LARGE_KEY] = err
                    raise err
            return message

        await self.app(scope, counted, send)
