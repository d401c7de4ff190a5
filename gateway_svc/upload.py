"""The request-body limits: ``--max-upload-mb`` on the upload routes (``/v1/audio/*``), ``--max-request-mb`` on the
JSON routes; 413 before the body is read whole. And the upload routes' multipart parsing (``read_form``), which
refuses a body cut before its closing boundary.

A ``Content-Length`` over the limit is answered at once, without reading the body; a body sent without one
(chunked) is counted as it arrives and refused once it passes the limit. Either way the gateway never holds more
than the limit of one request.
"""

from __future__ import annotations

import contextlib

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from gateway_svc.errors import TOO_LARGE_KEY, GatewayError, bad_request

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
    starting with one of ``upload_prefixes``, ``request_bytes`` on the others (JSON bodies); and the upload bytes
    held at once, ``uploads_in_flight_bytes`` (0: no bound): an upload holds its declared length (without one, the
    bytes received so far) for its whole call, since it spools to /tmp until the call ends; past the budget a 503,
    before the body is read when its length is declared; one upload alone is never refused by the budget. Used on
    the event loop only: the count needs no lock."""

    def __init__(
        self,
        app,
        upload_bytes: int,
        request_bytes: int,
        upload_prefixes: tuple[str, ...] = ("/v1/audio/",),
        uploads_in_flight_bytes: int = 0,
    ) -> None:
        self.app = app
        self.upload_bytes = upload_bytes
        self.request_bytes = request_bytes
        self.upload_prefixes = upload_prefixes
        self.uploads_in_flight_bytes = uploads_in_flight_bytes
        self.in_flight = 0  # upload bytes reserved by the calls running

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
        budget = self.uploads_in_flight_bytes if audio else 0
        declared = int(length) if length is not None and length.isdigit() else None
        reserved = 0  # this call's share of ``in_flight``: its declared length, else the bytes received so far
        if budget and declared is not None:
            if self.in_flight and self.in_flight + declared > budget:  # one upload alone always fits
                await self._over_budget(budget).response()(scope, receive, send)
                return
            reserved = declared
            self.in_flight += reserved
        received = 0

        async def counted():
            nonlocal received, reserved
            message = await receive()
            if message["type"] == "http.request":
                chunk = len(message.get("body", b""))
                received += chunk
                if received > bound:
                    err = too_large(limit, audio)
                    # The route's handler answers 413; FastAPI's body parsing turns any exception of the body's
                    # read into its own 400, so the error also waits in the scope for errors.install to find.
                    scope[TOO_LARGE_KEY] = err
                    raise err
                if budget and declared is None:  # chunked: counted as it arrives
                    reserved += chunk
                    self.in_flight += chunk
                    if self.in_flight > budget and self.in_flight > reserved:
                        err = self._over_budget(budget)
                        scope[TOO_LARGE_KEY] = err
                        raise err
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.in_flight -= reserved

    def _over_budget(self, budget: int) -> GatewayError:
        return GatewayError(
            503,
            f"this gateway holds {self.in_flight / 1e6:.1f} MB of uploads already, at most {budget / 1e6:g} MB at "
            "once (--max-uploads-in-flight-mb); retry later",
            code="server_overloaded",
        )


# A multipart body cut before its closing boundary (RFC 2046 5.1.1: ``--boundary--``): python-multipart's finalize()
# does not check it, so Starlette's form held the parts that ended and silently dropped the cut one (the file).
TRUNCATED_MULTIPART = (
    "the multipart body ended before its closing boundary (--<boundary>--): the upload was cut off; send the whole "
    "upload"
)


class _EndCheckingParser(MultiPartParser):
    """Starlette's multipart parser, noting whether python-multipart reached the closing boundary (its ``end``)."""

    ended = False

    def on_end(self) -> None:
        self.ended = True


async def read_form(request, max_files: int, max_fields: int) -> FormData:
    """``request.form()`` of a ``multipart/form-data`` body, refusing one that is malformed or cut off.

    Args:
        request: the Starlette request; its Content-Type is multipart/form-data (with a boundary).
        max_files, max_fields: the most file parts and text fields accepted.

    Returns:
        The form; the caller closes its files (``UploadFile.close``).

    Raises:
        GatewayError: 400, a malformed body, too many parts, or a body that ended before its closing boundary
            (the message says to send the whole upload); the 413 of ``UploadLimitMiddleware`` as it reads.
    """
    try:
        async with contextlib.aclosing(request.stream()) as stream:
            parser = _EndCheckingParser(request.headers, stream, max_files=max_files, max_fields=max_fields)
            form = await parser.parse()
    except MultiPartException as exc:
        raise bad_request(f"the multipart body is malformed: {exc.message}") from None
    if not parser.ended:
        await form.close()
        raise bad_request(TRUNCATED_MULTIPART)
    return form
