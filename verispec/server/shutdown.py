"""The uvicorn server ``verispec serve`` runs: a shutdown that tells every client what happened.

The first Ctrl-C (or SIGTERM) stops admission: new requests get 503 with ``Retry-After`` while
the requests in flight finish, for at most the grace period; then they are aborted. A second
Ctrl-C aborts them at once. Either way every client hears of it before its connection closes: a
stream gets an error event and ``[DONE]``, a non-streaming request an OpenAI-style 503 body with
``Retry-After``. Only if the connections are still open ``FORCE_SECONDS`` after the abort does
the server stop waiting for them (uvicorn's own second Ctrl-C drops them at once, mid-answer).
"""

from __future__ import annotations

import time
from types import FrameType

import uvicorn

from verispec.server.runner import EngineRunner

#: Seconds between aborting the requests in flight and closing connections that are still open.
FORCE_SECONDS = 2.0


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown drains ``runner`` first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, runner: EngineRunner, grace_seconds: float) -> None:
        super().__init__(config)
        self.runner = runner
        self.grace_seconds = grace_seconds
        self._force_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:  # the first signal: drain for the grace period, then abort
            self.runner.begin_shutdown(self.grace_seconds)
            self.should_exit = True
            return
        self.runner.abort_now()  # a second signal: abort now, tell the clients, then stop waiting
        if self._force_at is None:
            self._force_at = time.monotonic() + FORCE_SECONDS

    @property
    def force_exit(self) -> bool:
        return self._force_at is not None and time.monotonic() >= self._force_at

    @force_exit.setter
    def force_exit(self, value: bool) -> None:
        if value and self._force_at is None:
            self._force_at = time.monotonic()
