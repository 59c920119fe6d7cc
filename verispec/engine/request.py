"""One request's life in the engine: its committed tokens, text, stop conditions and timings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.config import SamplingParams
from verispec.engine.detokenize import Decoder, IncrementalDetokenizer
from verispec.metrics import SpecStats
from verispec.sampling import TokenHistory


@dataclass
class Timings:
    """Wall-clock marks of one request (``time.perf_counter`` seconds) and its step costs."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # when each step delivered tokens
    draft_seconds: float = 0.0  # this request's share of the drafting time of its steps
    verify_seconds: float = 0.0  # its share of the target passes (verification and plain decoding)
    prefill_seconds: float = 0.0  # the prompt's pass (its batch's), which yields the first token
    steps: int = 0

    def summary(self, num_tokens: int) -> dict[str, float | None]:
        """TTFT, inter-token latency (between streamed chunks) p50/p95, time per output token,
        tokens/s, the prefill, and the measured draft / verify milliseconds per decoding step (the
        prefill is not a step)."""
        ttft = None if self.first_token is None else self.first_token - self.arrival
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]
        end = self.finished if self.finished is not None else time.perf_counter()
        decode = end - self.first_token if self.first_token is not None else None
        return {
            "ttft_s": ttft,
            "itl_p50_s": _quantile(gaps, 0.5),
            "itl_p95_s": _quantile(gaps, 0.95),
            "tpot_s": decode / (num_tokens - 1) if decode is not None and num_tokens > 1 else None,
            "e2e_s": end - self.arrival,
            "tokens_per_s": num_tokens / (end - self.arrival) if end > self.arrival else None,
            "prefill_ms": 1e3 * self.prefill_seconds,
            "draft_ms_per_step": 1e3 * self.draft_seconds / self.steps if self.steps else None,
            "verify_ms_per_step": 1e3 * self.verify_seconds / self.steps if self.steps else None,
        }


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


@dataclass
class RequestOutput:
    """What one engine step produced for one request (streaming), or its final state.

    ``new_token_ids`` / ``new_text``: committed in this step. ``token_ids`` / ``text``: everything
    so far. ``finish_reason``: "stop" (EOS or a stop string), "length" (max_tokens or the context
    limit), "abort", or "error" (then ``error`` says why); None while running.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stats: SpecStats
    timings: dict[str, float | None]
    lossless: bool = True
    error: str | None = None
    prompt_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "lossless": self.lossless,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "spec": self.stats.as_dict(),
            "timings": self.timings,
        }


class Request:
    """Mutable state of one running request (engine-internal)."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        tokenizer: Decoder | None,
        eos_ids: Sequence[int],
        max_output: int,
    ) -> None:
        self.request_id = request_id
        #: The prompt, then every committed output token: the request's one copy of its tokens (the
        #: drafters read this list, which grows as tokens are committed, and keep none of their own).
        self.tokens: list[int] = list(prompt_ids)
        self.prompt_len = len(self.tokens)
        self.params = params
        self.generator = generator
        self.eos_ids = frozenset(eos_ids)
        self.max_output = min(params.max_tokens, max_output)
        self.pending: int | None = None  # last committed token, not yet in the target's cache
        self.slot: int | None = None
        self.stats = SpecStats()
        self.timings = Timings()
        self.detok = IncrementalDetokenizer(tokenizer, self.prompt_ids) if tokenizer is not None else None
        self.text = ""
        self._stop_scan = 0  # text before this offset has been searched for stop strings
        self._released = 0  # text before this offset has been streamed
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.history: TokenHistory | None = None  # [1, V] rows, only when penalties are on

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def cache_slot(self) -> int:
        """The target cache slot (only while running)."""
        assert self.slot is not None, "request is not running"
        return self.slot

    def commit(self, token_ids: Sequence[int]) -> tuple[list[int], str]:
        """Append committed tokens one by one, stopping at EOS, a stop string or the length limit.

        EOS is not part of the output; a stop string ends the text where it starts (the token that
        completed it is kept in ``token_ids``). While running, the last ``len(longest stop) - 1``
        characters are held back, so that streamed text never has to be taken back. Returns the
        tokens added and the text released to the client.
        """
        added: list[int] = []
        for token in token_ids:
            if self.finished:
                break
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            self.tokens.append(token)
            added.append(token)
            if self.detok is not None:
                self.text += self.detok.push([token])
                if self.params.stop and self._truncate_at_stop():
                    self.finish_reason = "stop"
                    break
            if self.num_output >= self.max_output:
                self.finish_reason = "length"
        if self.finished and self.detok is not None and self.finish_reason != "stop":
            self.text += self.detok.flush()
        hold = 0 if self.finished or not self.params.stop else max(len(s) for s in self.params.stop) - 1
        release = max(self._released, len(self.text) - hold)
        delta = self.text[self._released : release]
        self._released = release
        return added, delta

    def _truncate_at_stop(self) -> bool:
        """Search the new text for a stop string; cut the text where the first one starts."""
        start = max(0, self._stop_scan - max(len(s) for s in self.params.stop) + 1)
        cuts = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        self._stop_scan = len(self.text)
        if not cuts:
            return False
        self.text = self.text[: min(cuts)]
        return True

    def output(self, new_ids: list[int], new_text: str, lossless: bool) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=self.output_ids,
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            stats=self.stats.merge(SpecStats()),  # a snapshot: the live counters keep moving
            timings=self.timings.summary(self.num_output) if self.finished else {},
            lossless=lossless,
            error=self.error,
            prompt_tokens=self.prompt_len,
        )
