"""Who may talk to the server: the Host check (DNS rebinding) and the optional API key, before any route runs.

A page on another site can make a browser send requests to a server on this machine.  Two defences close
that, together with the JSON-only POST routes (``app._read_body``: a cross-site form or ``text/plain``
fetch cannot send ``application/json`` without a CORS preflight, which this server never grants):

- **Host**: a DNS-rebinding page reaches ``127.0.0.1`` under its own name (``Host: evil.example:8000``).
  A request is answered only when its Host is an IP address (rebinding needs a name the attacker
  controls), ``localhost``, the name the server is bound to, or one of ``allowed_hosts`` (``"*"`` for any,
  ``"*.example.org"`` for its subdomains): set them when the server sits behind a name (a proxy, a DNS
  entry).  Otherwise 400 ``invalid_host``.
- **API key** (``api_key``, or the ``MARS_API_KEY`` environment variable; vLLM's ``--api-key``): every
  ``/v1`` route then needs ``Authorization: Bearer <key>`` (what OpenAI clients send as ``api_key``), else
  401 ``invalid_api_key``.  ``/health``, ``/metrics``, ``/stats`` and the page stay open, as vLLM leaves
  its health and metrics routes open (probes and scrapers carry no key; the page asks for the key and
  sends it).
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from .schemas import APIError

PROTECTED_PREFIX = "/v1"


def host_name(header: str | None) -> str | None:
    """The name part of a Host header (``[::1]:8000`` -> ``::1``, ``Example.org.:80`` -> ``example.org``)."""
    if not header:
        return None
    header = header.strip()
    if header.startswith("["):  # an IPv6 literal
        end = header.find("]")
        return header[1:end].lower() if end > 0 else None
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.lower().rstrip(".") or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostRule:
    """Which Host headers the server answers (see the module docstring)."""

    def __init__(self, bound_host: str, allowed_hosts: Sequence[str] | None = None):
        names = [bound_host, "localhost", *(allowed_hosts or [])]
        self.patterns = sorted({n.strip().lower().rstrip(".") for n in names if n and n.strip()})

    def allows(self, header: str | None) -> bool:
        name = host_name(header)
        if name is None:
            return False
        if _is_ip(name):
            return True
        for p in self.patterns:
            if p == "*" or p == name or (p.startswith("*.") and name.endswith(p[1:])):
                return True
        return False


class RequestGuard:
    """Plain ASGI middleware: refuses a request with a foreign Host (400) or, on ``/v1`` routes when an API
    key is set, without it (401), OpenAI-shaped like every other error."""

    def __init__(self, app, hosts: HostRule, api_key: str | None = None):
        self.app, self.hosts, self.api_key = app, hosts, api_key or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        err = self.check(headers, scope.get("path", ""))
        if err is not None:
            response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def check(self, headers: Headers, path: str) -> APIError | None:
        host = headers.get("host")
        if not self.hosts.allows(host):
            return APIError(
                400,
                f"this server does not answer to the Host {host!r}: allowed are IP addresses and "
                f"{self.hosts.patterns} (set allowed_hosts to serve under another name)",
                None,
                "invalid_host",
            )
        if self.api_key and (path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                return APIError(
                    401,
                    "missing or incorrect API key: send it as 'Authorization: Bearer <key>' "
                    "(the api_key of an OpenAI client)",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return None
