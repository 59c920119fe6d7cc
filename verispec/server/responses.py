"""OpenAI response objects and server-sent events, built from the engine's :class:`RequestOutput`.

Every answer follows OpenAI's schema (``id``, ``object``, ``created``, ``model``, ``choices``,
``usage``) and adds a ``spec`` object: what speculation did for this request, with vLLM's
definitions (:mod:`verispec.metrics`)::

    "spec": {"drafts": 12, "drafted": 48, "accepted": 31, "acceptance_rate": 0.646,
             "mean_acceptance_length": 3.58, "accepted_per_pos": [11, 9, 7, 4],
             "free_drafts": 3, "free_drafted": 15, "free_accepted": 9, "lossless": true}

``drafts``: verification steps that checked at least one draft token; ``drafted`` / ``accepted``:
draft tokens proposed / accepted; ``acceptance_rate`` = accepted / drafted; ``mean_acceptance_length``
= 1 + accepted / drafts (output tokens per target pass); ``accepted_per_pos[i]``: steps whose first
``i + 1`` draft tokens were all accepted; ``free_drafts`` / ``free_drafted`` / ``free_accepted``:
the drafts among them that cost no model pass (a composite drafter's lookup), their tokens and
accepted tokens; ``lossless``: false only for a lossy acceptance rule;
``warnings``: what the client should know about this answer (today: a ``seed`` given while the
server chooses the draft length per step, which keeps the output's law but not its exact text).

Streaming sends ``data: {chunk}\\n\\n`` events and ends with ``data: [DONE]``. The chunk that carries
``finish_reason`` also carries ``usage`` and ``spec``; with ``stream_options.include_usage`` one more
chunk with empty ``choices`` follows, as OpenAI sends it. A failure after the stream has started is
one ``data: {"error": {...}}`` event (the OpenAI client raises it as an ``APIError``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from verispec.engine.request import RequestOutput

Kind = Literal["completion", "chat"]


def spec_object(out: RequestOutput, warnings: tuple[str, ...] = ()) -> dict[str, Any]:
    stats = out.stats
    return {
        "drafts": stats.num_drafts,
        "drafted": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "accepted_per_pos": list(stats.accepted_per_pos),
        "free_drafts": stats.num_free_drafts,
        "free_drafted": stats.num_free_draft_tokens,
        "free_accepted": stats.num_free_accepted_tokens,
        "lossless": out.lossless,
        "warnings": list(warnings),
    }


def usage_object(out: RequestOutput) -> dict[str, int]:
    completion = len(out.token_ids)
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": out.prompt_tokens + completion,
    }


def response(
    kind: Kind, request_id: str, created: int, model: str, out: RequestOutput, warnings: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The whole answer of a non-streaming request."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        obj = "text_completion"
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage_object(out),
        "spec": spec_object(out, warnings),
    }


class ChunkWriter:
    """Streaming chunks of one request, as SSE event bytes."""

    def __init__(
        self, kind: Kind, request_id: str, created: int, model: str, include_usage: bool,
        warnings: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.kind = kind
        self.warnings = warnings
        self.request_id = request_id
        self.created = created
        self.model = model
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        head = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}
        return event(head | {"system_fingerprint": None, "choices": choices} | extra)

    def start(self) -> bytes | None:
        """The first chunk: chat announces the assistant's role; completions send nothing."""
        if self.kind != "chat":
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def delta(self, out: RequestOutput) -> list[bytes]:
        """Events for one engine output: its new text, and at the end the finish reason with
        ``usage`` and ``spec`` (then the usage-only chunk if asked for). Nothing for an output
        that released no text and did not finish (text held back at a possible stop string)."""
        if not out.new_text and not out.finished:
            return []
        if self.kind == "chat":
            delta = {"content": out.new_text} if out.new_text else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.new_text, "logprobs": None, "finish_reason": out.finish_reason}
        if not out.finished:
            return [self._chunk([choice])]
        spec = spec_object(out, self.warnings)
        events = [self._chunk([choice], usage=usage_object(out), spec=spec)]
        if self.include_usage:
            events.append(self._chunk([], usage=usage_object(out), spec=spec))
        return events


def event(obj: Any) -> bytes:
    """One server-sent event holding ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
