"""Helpers of the server tests: a tiny engine built in code, and a live uvicorn server in a thread."""

from __future__ import annotations

import functools
import socket
import threading
import time
from typing import Any

from tests.tiny import byte_tokenizer, tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine, RequestOutput
from verispec.formats.tokenizer import Tokenizer

VOCAB = 257  # 256 bytes + <eos>
EOS = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Token ids 0..93 are the printable ASCII bytes '!'..'~' (the byte-level alphabet, sorted); banning
# the other bytes makes every output printable, so equal texts mean equal tokens.
PRINTABLE_ONLY = {str(i): -100.0 for i in range(94, 256)}


@functools.cache
def models() -> tuple[Any, Any]:
    """The tiny target and draft, built once per process (read-only: engines share them)."""
    return tiny_pair(VOCAB, eos=EOS)


def tokenizer() -> Tokenizer:
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_engine(
    max_batch: int = 8, max_len: int = 512, k: int | None = 3, cls: type[Engine] = Engine, **kw: Any
) -> Engine:
    """The tiny target/draft pair (fixed K, so seeded outputs do not depend on the batch)."""
    target, draft = models()
    drafter = make_drafter("model", draft_model=draft, vocab_size=VOCAB, max_batch=max_batch, max_len=max_len + 16)
    return cls(
        target, tokenizer(), drafter, EngineConfig(max_batch=max_batch, max_len=max_len, num_draft_tokens=k), **kw
    )


def reference(prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
    """The request run alone on a fresh engine, without the server."""
    return tiny_engine().generate([prompt_ids], [params])[0]


class GatedEngine(Engine):
    """An engine whose steps wait for ``gate`` (tests hold requests in flight with it)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # set while a step waits at a closed gate
        self.fail_next = False

    def step(self) -> list[RequestOutput]:
        if not self.gate.is_set():
            self.blocked.set()
        self.gate.wait()
        self.blocked.clear()
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step failure")
        return super().step()


class LiveServer:
    """``app`` served by uvicorn on a free loopback port, in a background thread."""

    def __init__(self, app: Any, graceful_seconds: float = 10.0) -> None:
        self.app = app
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on such sockets (else 40 ms delayed-ACK stalls)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        import uvicorn

        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_seconds)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop"

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.stop()
        self.sock.close()

    @property
    def runner(self) -> Any:
        return self.app.state.server.runner


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(condition: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
