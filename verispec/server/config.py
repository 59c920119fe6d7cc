"""The server's settings: names, the API key and the limits that keep it answering under load."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Settings of :func:`verispec.server.create_app`.

    ``served_model_names``: the names requests may give as ``model`` (the first is reported);
    empty = the target's name. ``api_key``: when set, ``/v1/*`` needs ``Authorization: Bearer KEY``
    (``/health`` and ``/metrics`` stay open, for probes and scrapers). ``max_queue``: requests
    admitted beyond the engine's running batch (``max_batch``); more get 429 with ``Retry-After``.
    ``max_prompt_tokens`` / ``max_tokens_limit``: the longest prompt and the largest ``max_tokens``
    accepted (default: the engine's context). ``max_body_bytes``: larger bodies get 413.
    ``shutdown_grace_seconds``: how long shutdown waits for requests in flight before aborting them.
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_queue: int = 64
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_grace_seconds: float = 30.0
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.served_model_names, str):
            object.__setattr__(self, "served_model_names", (self.served_model_names,))
        if not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ConfigError(f"served model names must be non-empty strings, got {self.served_model_names!r}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isascii() or " " in self.api_key):
            raise ConfigError("the API key must be non-empty printable ASCII without spaces")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.shutdown_grace_seconds < 0:
            raise ConfigError(f"shutdown_grace_seconds must be >= 0, got {self.shutdown_grace_seconds}")
        if self.retry_after_seconds < 1:
            raise ConfigError(f"retry_after_seconds must be >= 1, got {self.retry_after_seconds}")
