"""The server's settings: names, the API key, the hosts it answers to, and the limits that keep it
answering under load."""

from __future__ import annotations

import math
from dataclasses import dataclass

from verispec.errors import ConfigError

#: Bytes of prompt text allowed per prompt token when no byte limit is set: no real text averages
#: more than a few bytes per token, so a prompt over this many bytes is refused before it is
#: tokenized (tokenizing megabytes costs seconds of CPU and memory that outlives the request).
DEFAULT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Settings of :func:`verispec.server.create_app`.

    ``served_model_names``: the names requests may give as ``model`` (the first is reported);
    empty = the target's name. ``api_key``: when set, ``/v1/*`` needs ``Authorization: Bearer KEY``
    and ``/docs``, ``/redoc`` and ``/openapi.json`` are off; ``/health`` stays open (for probes)
    and ``/metrics`` needs the key too unless ``public_metrics``. ``allowed_hosts``: host names the
    ``Host`` header may carry besides IP literals and ``localhost`` (a defence against DNS
    rebinding; ``("*",)`` turns the check off). ``max_queue``: requests admitted beyond the
    engine's running batch (``max_batch``); more get 429 with ``Retry-After``.
    ``max_prompt_tokens`` / ``max_tokens_limit``: the longest prompt and the largest ``max_tokens``
    accepted (default: the engine's context). ``max_prompt_bytes``: prompt text (or the chat
    messages' text) longer than this is refused before tokenizing (default
    ``DEFAULT_BYTES_PER_TOKEN`` x ``max_prompt_tokens``); ``max_messages``: messages per chat
    request. ``max_body_bytes``: larger bodies get 413. ``shutdown_grace_seconds``: how long
    shutdown waits for requests in flight before aborting them.
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    public_metrics: bool = False
    allowed_hosts: tuple[str, ...] = ()
    max_queue: int = 64
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_prompt_bytes: int | None = None
    max_messages: int = 512
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_grace_seconds: float = 30.0
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.served_model_names, str):
            object.__setattr__(self, "served_model_names", (self.served_model_names,))
        if not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ConfigError(f"served model names must be non-empty strings, got {self.served_model_names!r}")
        if self.api_key is not None and (
            not self.api_key or not self.api_key.isascii() or not self.api_key.isprintable() or " " in self.api_key
        ):
            raise ConfigError(
                "the API key must be non-empty printable ASCII without spaces (an empty key would turn "
                "authentication off: leave the key out to serve without one)"
            )
        if isinstance(self.allowed_hosts, str):
            object.__setattr__(self, "allowed_hosts", (self.allowed_hosts,))
        for host in self.allowed_hosts:
            if not isinstance(host, str) or not host or not host.isascii() or any(c in host for c in " /@"):
                raise ConfigError(f"allowed hosts must be host names such as example.com, got {host!r}")
        object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("max_prompt_tokens", "max_tokens_limit", "max_prompt_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_messages < 1:
            raise ConfigError(f"max_messages must be >= 1, got {self.max_messages}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        grace = self.shutdown_grace_seconds
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not math.isfinite(grace) or grace < 0:
            raise ConfigError(f"shutdown_grace_seconds must be a finite number >= 0, got {grace!r}")
        if self.retry_after_seconds < 1:
            raise ConfigError(f"retry_after_seconds must be >= 1, got {self.retry_after_seconds}")
