"""The request-body limit of the upload routes (``/v1/audio/*``): 413 before the body is read whole.

A ``Content-Length`` over the limit is answered at once, without reading the body; a body sent without one
(chunked) is counted as it arrives and refused once it passes the limit. Either way the gateway never holds more
than the limit of one request.
"""

from __future__ import annotations

import json

from gateway_svc.errors import GatewayError, error_body

# Multipart framing and the small form fields beside the file (OpenAI's limit is on the file).
FORM_OVERHEAD_BYTES = 64 * 1024


def too_large(limit_bytes: int) -> GatewayError:
    return GatewayError(
        413,
        f"the upload is over this server's limit of {limit_bytes / 1e6:g} MB (--max-upload-mb); "
        "send a shorter or compressed file (flac, mp3, ogg)",
        "file",
        "file_too_large",
    )


class UploadLimitMiddleware:
    """ASGI middleware bounding the body of requests whose path starts with one of ``prefixes``.

    Args:
        limit_bytes: the file's limit; the body may exceed it by ``FORM_OVERHEAD_BYTES``.
    """

    def __init__(self, app, limit_bytes: int, prefixes: tuple[str, ...] = ("/v1/audio/",)) -> None:
        self.app = app
        self.limit_bytes = limit_bytes
        self.prefixes = prefixes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        bound = self.limit_bytes + FORM_OVERHEAD_BYTES
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > bound:
            await _send_error(send, too_large(self.limit_bytes))
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > bound:
                    raise too_large(self.limit_bytes)  # the route's error handler answers 413
            return message

        await self.app(scope, counted, send)


async def _send_error(send, err: GatewayError) -> None:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
