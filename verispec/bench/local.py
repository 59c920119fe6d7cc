"""In-process deployments for the gate: two engines on one loaded target, each behind its own
OpenAI-compatible server (uvicorn in a background thread, on a free loopback port), and the memory
they hold.

The baseline engine (no drafter) and the speculative engine share the target's weights (loaded
once: the same numbers in both, half the memory and load time), each with its own KV cache and the
same vocabulary cut, so the two differ only in drafting. Memory is reported two ways, both honest
about their scope:

- tensor accounting: bytes of every tensor a configuration's engine holds (target weights, KV
  caches, the draft model and its cache), allocated size (the KV caches are zero-filled on demand:
  pages count in RSS only once touched);
- process RSS: the process's resident set at the start of each run and its high-water mark during
  the run (Linux: ``VmHWM``, reset through ``/proc/self/clear_refs``; elsewhere the high-water mark
  since the process started). Both configurations live in this process, so RSS is process-wide;
  the growth during a run is what that run added (activations, first-touched KV pages, buffers).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verispec.config import DRAFT_CONTEXT_WINDOW, EngineConfig
from verispec.engine.engine import Engine
from verispec.engine.recorder import StepRecord
from verispec.errors import ConfigError
from verispec.pipeline import Pipeline, build

log = logging.getLogger(__name__)


def local_pipelines(
    target: str,
    draft: str | None,
    *,
    drafter: str = "model",
    k: int | None = None,
    dtype: Any = "bf16",
    draft_dtype: Any = None,
    device: str = "cpu",
    max_batch: int = 4,
    max_len: int = 2048,
    draft_head: int | None = None,
    tree: str | None = None,
    tree_children: str = "fixed",
    rule: str = "rejection",
    allow_lossy: bool = False,
    datastore: str | None = None,
    heads: str | None = None,
    confidence_stop: bool = True,
    draft_window: int | None = DRAFT_CONTEXT_WINDOW,
) -> tuple[Pipeline, Pipeline]:
    """The baseline and speculative pipelines of one pair, sharing the loaded target."""
    if drafter == "none" or k == 0:
        raise ConfigError("the gate compares speculation against plain decoding: choose a drafter and K >= 1 (or auto)")
    spec = build(
        target, draft, drafter=drafter, k=k, dtype=dtype, draft_dtype=draft_dtype, device=device,
        max_batch=max_batch, max_len=max_len, draft_head=draft_head, tree=tree, tree_children=tree_children,
        rule=rule, allow_lossy=allow_lossy, datastore=datastore, heads=heads, confidence_stop=confidence_stop,
        draft_window=draft_window,
    )  # fmt: skip
    return Pipeline(baseline_engine(spec.engine), spec.target, None), spec


def baseline_engine(spec: Engine) -> Engine:
    """Plain decoding on ``spec``'s target object (same weights, same vocabulary cut, own cache)."""
    config = EngineConfig(
        max_batch=spec.config.max_batch, max_len=spec.config.max_len, prefill_chunk=spec.config.prefill_chunk
    )
    return Engine(
        spec.target, spec.tokenizer, None, config, vocab_limit=spec.vocab_limit, eos_token_ids=spec.eos_token_ids
    )


class LocalServer:
    """``app`` served by uvicorn on a free loopback port in a daemon thread (context manager)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets (no 40 ms delayed-ACK stalls).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LocalServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise ConfigError("the in-process server did not start; see the log above")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@dataclass
class LocalDeployment:
    """One configuration served in this process: its engine (or the pipeline holding it), its URL."""

    name: str
    source: Engine | Pipeline
    url: str = ""

    @property
    def engine(self) -> Engine:
        return self.source.engine if isinstance(self.source, Pipeline) else self.source


def serve_pair(
    stack: ExitStack, baseline: Engine | Pipeline, spec: Engine | Pipeline
) -> tuple[LocalDeployment, LocalDeployment]:
    """Start both servers (stopped when ``stack`` closes); returns the two deployments."""
    try:
        from verispec.server import ServerConfig, create_app
    except ImportError as exc:
        raise ConfigError(f"the gate's local servers need {exc.name}: pip install 'verispec[serve]'") from None
    out = []
    for name, pipe in (("baseline", baseline), ("spec", spec)):
        app = create_app(pipe, ServerConfig(max_queue=1024))
        server = stack.enter_context(LocalServer(app))
        out.append(LocalDeployment(name, pipe, server.url))
    return out[0], out[1]


class StepWindow:
    """The engine step records appended between :meth:`open` and :meth:`close` (read without
    touching the engine: records already present are recognised by identity)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._before: list[StepRecord] = []

    def open(self) -> None:
        self._before = list(self.engine.steps)

    def close(self) -> list[StepRecord]:
        seen = {id(s) for s in self._before}
        return [s for s in list(self.engine.steps) if id(s) not in seen]


# ---------------------------------------------------------------------------------------- memory
def tensor_bytes(root: object) -> dict[str, int]:
    """Bytes of the tensors reachable from ``root`` through attributes, lists and dicts, each byte
    once (tensors that share a storage count the union of the bytes they span, not the storage:
    weights mapped from a file are views of the whole file): ``weights`` (parameters and buffers
    of modules) and ``other`` (KV caches, ...)."""
    seen_objects: set[int] = set()
    spans: dict[int, list[tuple[int, int]]] = {}  # storage -> [(first byte, end byte)]
    is_weight: dict[int, bool] = {}

    def add(t: torch.Tensor, weight: bool) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr() or id(storage)
        start = t.storage_offset() * t.element_size()
        elements = 1 + sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
        end = min(start + elements * t.element_size(), storage.nbytes())
        spans.setdefault(key, []).append((int(start), int(end)))
        is_weight[key] = weight or is_weight.get(key, False)

    def union(ranges: list[tuple[int, int]]) -> int:
        total, end = 0, 0
        for a, b in sorted(ranges):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    def walk(obj: object, depth: int) -> None:
        if depth > 8 or id(obj) in seen_objects or isinstance(obj, str | bytes | int | float | bool | type(None)):
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            add(obj, False)
        elif isinstance(obj, nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                add(t, True)
            for value in vars(obj).values():
                walk(value, depth + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value, depth + 1)
        elif isinstance(obj, list | tuple | set | deque):
            items = list(obj)
            if items and isinstance(items[0], str | bytes | int | float | bool):
                return  # token ids and the like
            for value in items:
                walk(value, depth + 1)
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
            values += [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
            for value in values:
                walk(value, depth + 1)

    walk(root, 0)
    sizes = {key: union(ranges) for key, ranges in spans.items()}
    return {
        "weights": sum(n for key, n in sizes.items() if is_weight[key]),
        "other": sum(n for key, n in sizes.items() if not is_weight[key]),
    }


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssMonitor:
    """Resident set size of this process and its high-water mark over a window (see the module
    docstring for what can and cannot be attributed)."""

    def __init__(self) -> None:
        self.resettable = sys.platform.startswith("linux") and self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return _status_kib("VmHWM") is not None

    def current(self) -> int | None:
        kib = _status_kib("VmRSS")
        return kib * 1024 if kib is not None else None

    def start(self) -> int | None:
        """Begin a window: reset the high-water mark; returns the RSS now (bytes)."""
        if self.resettable:
            self._reset()
        return self.current()

    def peak(self) -> int | None:
        """High-water RSS (bytes) since :meth:`start` (since process start where it cannot be reset)."""
        kib = _status_kib("VmHWM")
        if kib is not None:
            return kib * 1024
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
        except (ImportError, OSError):
            return None

    @property
    def method(self) -> str:
        if self.resettable:
            return "VmHWM per run (reset via /proc/self/clear_refs): process-wide, both configurations resident"
        return "high-water mark since process start (cannot be reset here): process-wide"


def memory_accounting(deployment: LocalDeployment) -> dict[str, Any]:
    """Static bytes a configuration holds (see :func:`tensor_bytes`)."""
    engine = deployment.engine
    total = tensor_bytes(engine)
    target = tensor_bytes(engine.target)
    drafter = tensor_bytes(engine.drafter)
    return {
        "tensor_bytes_total": total["weights"] + total["other"],
        "target_weight_bytes": target["weights"],
        "kv_cache_bytes": total["other"] - drafter["other"],
        "drafter_weight_bytes": drafter["weights"],
        "drafter_cache_bytes": drafter["other"],
    }


def iter_entries(records: list[StepRecord]) -> Iterator[tuple[int, int, bool]]:
    """``(draft tokens, accepted, free)`` per request per step (``free``: the draft cost no model
    pass, a composite's lookup)."""
    for r in records:
        free = r.free_rows or (False,) * len(r.draft_tokens)
        yield from zip(r.draft_tokens, r.accepted, free, strict=False)
