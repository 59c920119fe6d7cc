"""The engine behind the server: one thread owns the :class:`~verispec.engine.Engine` and steps it.

The engine is not thread-safe, so exactly one thread touches it. The event loop talks to that
thread through a thread-safe command queue (add, abort, stop), which the thread drains between
steps; the thread answers through ``loop.call_soon_threadsafe``: the acknowledgement of each add
(or the engine's error, so that a bad request is a 4xx before any byte is streamed), and after
each step the outputs, routed by request id to each request's own :class:`asyncio.Queue`. The
thread sleeps on an event while there is no work.

Admission is bounded: at most ``max_batch`` requests run and ``max_queue`` more wait; beyond that
:meth:`EngineRunner.submit` raises :class:`QueueFullError` (429) at once, so nothing grows without
bound. A request whose client goes away is aborted at once (its slot and caches are freed before
the next step). Shutdown stops admission (:class:`ShuttingDownError`, 503), lets the requests in
flight finish for a grace period, aborts the rest (their clients get an error, not a hang), stops
the thread and joins it; :meth:`EngineRunner.begin_shutdown` starts the same drain from a signal
handler, so that requests cut by the deadline are told so while their connections are still open.
If a step raises, the requests in flight fail with the engine's message and the thread goes on
serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from verispec.config import SamplingParams
from verispec.engine.engine import Engine
from verispec.engine.request import RequestOutput
from verispec.errors import VerispecError
from verispec.metrics import SpecStats
from verispec.server.metrics import MetricsRecorder

log = logging.getLogger(__name__)


class QueueFullError(VerispecError):
    """Every running slot and every queue place is taken; retry later."""


class ShuttingDownError(VerispecError):
    """The server is shutting down (or its engine thread has stopped) and admits no request."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    ack: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class RequestHandle:
    """One admitted request, as the event loop sees it: its outputs, in order."""

    def __init__(self, runner: EngineRunner, request_id: str, prompt_tokens: int) -> None:
        self.runner = runner
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.final: RequestOutput | None = None
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.final is not None

    def _put(self, out: RequestOutput) -> None:
        if out.finished:
            self.final = out
        self._queue.put_nowait(out)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for this request, the last one finished."""
        while True:
            out = await self._queue.get()
            yield out
            if out.finished:
                return

    async def result(self) -> RequestOutput:
        """The final output (waits for the request to finish)."""
        async for out in self.outputs():
            if out.finished:
                return out
        raise AssertionError("unreachable: outputs() ends with a finished output")

    def abort(self) -> None:
        """Stop the request now if it is still running (the client went away). Idempotent."""
        if self.final is None:
            self.runner.abort(self.request_id)


class EngineRunner:
    """Runs ``engine`` in a background thread for an asyncio server (see the module docstring)."""

    def __init__(self, engine: Engine, *, max_queue: int = 64, recorder: MetricsRecorder | None = None) -> None:
        self.engine = engine
        self.capacity = engine.config.max_batch + max_queue
        self.recorder = recorder
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handles: dict[str, RequestHandle] = {}  # event-loop side only
        self._idle: asyncio.Event | None = None
        self._accepting = False
        self._abort_at: float | None = None  # time.monotonic() after which requests in flight are aborted
        # engine-thread side only
        self._last: dict[str, RequestOutput | None] = {}
        self._prompt_tokens: dict[str, int] = {}

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will submit requests."""
        if self._thread is not None:
            raise RuntimeError("the engine runner was already started")
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.alive

    @property
    def num_live(self) -> int:
        """Admitted requests not finished yet (running, or waiting for a slot)."""
        return len(self._handles)

    def begin_shutdown(self, grace_seconds: float | None = None) -> None:
        """Admit no more requests; the ones in flight go on, for at most ``grace_seconds`` if
        given (then they are aborted and their clients told so). Only sets attributes, so that
        it is safe to call from a signal handler."""
        self._accepting = False
        if grace_seconds is not None and self._abort_at is None:
            self._abort_at = time.monotonic() + grace_seconds

    def abort_now(self) -> None:
        """Stop admission and abort every request in flight at once (their clients are told so).
        Safe from a signal handler."""
        self._accepting = False
        self._abort_at = time.monotonic()
        self._wake.set()

    async def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestHandle:
        """Admit a request; returns once the engine has accepted it. Raises
        :class:`QueueFullError`, :class:`ShuttingDownError`, or the engine's own error
        (:class:`~verispec.errors.ConfigError` / :class:`~verispec.errors.InputError`)."""
        if not self.accepting or self._loop is None:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        if len(self._handles) >= self.capacity:
            raise QueueFullError(
                f"the server is at capacity ({self.engine.config.max_batch} running, "
                f"{self.capacity - self.engine.config.max_batch} queued); retry later"
            )
        if request_id in self._handles:
            raise VerispecError(f"request id {request_id!r} is already in use")
        handle = RequestHandle(self, request_id, len(prompt_ids))
        self._handles[request_id] = handle
        ack: asyncio.Future[None] = self._loop.create_future()
        self._send(_Add(request_id, list(prompt_ids), params, time.perf_counter(), ack))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)  # queued behind the add: the request never runs for long
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request (from the event loop): forgotten here at once, freed in the engine
        before its next step."""
        if request_id in self._handles:
            self._forget(request_id)
            self._send(_Abort(request_id))

    async def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stop admission, wait up to ``grace_seconds`` for the requests in flight, abort the
        rest, stop and join the engine thread."""
        self.begin_shutdown(grace_seconds)
        if self._thread is None:
            return
        if self._handles and self._idle is not None:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), grace_seconds)
            except TimeoutError:
                log.warning("aborting %d requests still running after %.1f s", len(self._handles), grace_seconds)
        self._send(_Stop())
        await asyncio.to_thread(self._thread.join)

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)
        if not self._handles and self._idle is not None:
            self._idle.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their requests (runs on the event loop)."""
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue  # aborted by its client in the meantime
            handle._put(out)
            if out.finished:
                self._forget(out.request_id)

    @staticmethod
    def _settle(ack: asyncio.Future[None], error: BaseException | None) -> None:
        if ack.done():
            return
        if error is None:
            ack.set_result(None)
        else:
            ack.set_exception(error)

    def _call_in_loop(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            log.debug("event loop closed; dropped a message from the engine thread")

    # --------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                if self._apply_commands():
                    break
                if self._abort_at is not None and self._last and time.monotonic() >= self._abort_at:
                    self._finish_all("abort", "the server is shutting down; the request was aborted")
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._publish_queue()
                    self._wake.wait()
                    self._wake.clear()
        except BaseException:
            log.exception("the engine thread failed; no more requests will be served")
        finally:
            self._accepting = False
            self._finish_all("abort", "the server is shutting down; the request was aborted")
            self._reject_pending()
            self._publish_queue()

    def _apply_commands(self) -> bool:
        """Apply queued commands; True when told to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False
            if isinstance(command, _Stop):
                return True
            if isinstance(command, _Abort):
                if self.engine.abort(command.request_id):
                    self._drop(command.request_id, "abort")
                continue
            try:
                self.engine.add_request(command.prompt_ids, command.params, command.request_id)
            except Exception as exc:  # the engine's checks (VerispecError) or a bug: the client hears of it
                self._call_in_loop(self._settle, command.ack, exc)
                continue
            self._last[command.request_id] = None
            self._prompt_tokens[command.request_id] = len(command.prompt_ids)
            if self.recorder is not None:
                self.recorder.added(command.request_id, command.arrival, len(command.prompt_ids))
            self._call_in_loop(self._settle, command.ack, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("an engine step failed; failing the requests in flight")
            self._finish_all("error", f"the engine failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        for out in outputs:
            if self.recorder is not None:
                self.recorder.output(out, now)
            if out.finished:
                self._last.pop(out.request_id, None)
                self._prompt_tokens.pop(out.request_id, None)
            elif out.request_id in self._last:
                self._last[out.request_id] = out
        self._call_in_loop(self._dispatch, outputs)
        self._publish_queue()

    def _drop(self, request_id: str, reason: str) -> None:
        self._last.pop(request_id, None)
        self._prompt_tokens.pop(request_id, None)
        if self.recorder is not None:
            self.recorder.finished(request_id, reason, time.perf_counter())

    def _finish_all(self, reason: str, message: str) -> None:
        """Abort every request in the engine and tell each client (``reason``: abort or error)."""
        finals = []
        for request_id, last in list(self._last.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already broken; the slot goes with it
                log.exception("could not abort request %s", request_id)
            finals.append(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    new_text="",
                    token_ids=list(last.token_ids) if last else [],
                    text=last.text if last else "",
                    finished=True,
                    finish_reason=reason,
                    stats=last.stats if last else SpecStats(),
                    timings={},
                    lossless=self.engine.lossless,
                    error=message,
                    prompt_tokens=self._prompt_tokens.get(request_id, 0),
                )
            )
            self._drop(request_id, reason)
        if finals:
            self._call_in_loop(self._dispatch, finals)

    def _reject_pending(self) -> None:
        """After the thread stops: refuse the adds still queued."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                error = ShuttingDownError("the server is shutting down and accepts no new requests")
                self._call_in_loop(self._settle, command.ack, error)

    def _publish_queue(self) -> None:
        if self.recorder is not None:
            running = sum(not r.finished for r in self.engine.running)
            self.recorder.queue(running, len(self.engine.waiting))
