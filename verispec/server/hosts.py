"""The ``Host`` check: a defence against DNS rebinding.

A web page on ``evil.example`` can make its own name resolve to ``127.0.0.1`` and then talk to a
server on the user's loopback as if it were its own origin: the browser sends
``Host: evil.example``. A request is answered only when its ``Host`` header (port aside) is an IP
literal (a browser then talks to that address as its origin, which the same-origin policy
covers), ``localhost``, or a name on the allow-list (``--allowed-host``; ``*`` turns the check
off). Anything else gets a 400 with an OpenAI-style error body before any handler runs.
"""

from __future__ import annotations

import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.server.errors import error_body


def host_name(header: str) -> str:
    """The host of a ``Host`` header, lower case, without its port (``[::1]:8000`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header


def host_allowed(header: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this ``Host`` header may be answered (see the module docstring)."""
    if "*" in allowed:
        return True
    host = host_name(header)
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.rstrip(".") in allowed


class HostCheck:
    """ASGI middleware that refuses HTTP requests whose ``Host`` is not allowed (see the module)."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        header = headers.get(b"host", b"").decode("latin-1")
        if host_allowed(header, self.allowed):
            await self.app(scope, receive, send)
            return
        message = (
            f"the Host header {header[:100]!r} is not one this server answers to; connect by IP address or "
            "localhost, or start the server with --allowed-host NAME"
        )
        body = json.dumps(error_body(400, message, code="invalid_host")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
