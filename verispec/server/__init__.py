"""OpenAI-compatible HTTP server with Prometheus metrics (thin: parse -> engine -> stream).

Modules: :mod:`~verispec.server.app` (endpoints, :func:`create_app`), :mod:`~verispec.server.runner`
(the engine's background thread), :mod:`~verispec.server.schemas` (request bodies),
:mod:`~verispec.server.responses` (answers and SSE chunks), :mod:`~verispec.server.errors`
(OpenAI-style error bodies), :mod:`~verispec.server.metrics` (Prometheus, vLLM's names),
:mod:`~verispec.server.config` (:class:`ServerConfig`). Needs the ``serve`` extra
(fastapi, uvicorn, prometheus-client).
"""

from verispec.server.app import create_app
from verispec.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
