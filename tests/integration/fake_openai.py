"""A minimal fake OpenAI-compatible streaming server for the load generator's tests.

It streams ``chunks`` text chunks per request (``delay`` seconds apart), sends ``usage`` when asked,
and exports Prometheus metrics in vLLM's or SGLang's naming whose counters move with every request
(each request: ``drafts`` verification steps of K = 2 draft tokens, ``accepted`` accepted in all, the
first position accepted ``pos0`` times). Requests whose prompt contains a failure keyword fail:
"FAIL429" -> 429, "FAIL500" -> 500, "MIDSTREAM" -> an error event after the first chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    scheme: str = "vllm"  # "vllm" or "sglang" or "none"
    chunks: int = 5
    delay: float = 0.0
    drafts: int = 4
    accepted: int = 6
    pos0: int = 4
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def metrics_text(state: FakeState) -> str:
    n = state.requests
    if state.scheme == "vllm":
        label = 'model_name="fake",engine="0"'
        lines = [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{{{label}}} {float(n * state.drafts)}",
            f"vllm:spec_decode_num_drafts_created{{{label}}} 1.7e9",
            f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {float(n * state.drafts * 2)}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {float(n * state.accepted)}",
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}} {float(n * state.pos0)}',
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="1"}} '
            f"{float(n * (state.accepted - state.pos0))}",
            f"vllm:num_preemptions_total{{{label}}} 0.0",
            "this line is not prometheus at all {",
        ]
    elif state.scheme == "sglang":
        lines = [
            "# TYPE sglang:spec_accept_length gauge",
            'sglang:spec_accept_length{model_name="fake"} 2.5',
            'sglang:spec_accept_rate{model_name="fake"} 0.75',
        ]
    else:
        lines = ["# nothing about speculation", "process_resident_memory_bytes 1.0e8"]
    return "\n".join(lines) + "\n"


def fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.scheme == "missing":
            return Response(status_code=404)
        return Response(metrics_text(state), media_type="text/plain")

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.bodies.append(body)
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
        if "FAIL429" in prompt:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error"}}, 429)
        if "FAIL500" in prompt:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> AsyncIterator[bytes]:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                for i in range(state.chunks):
                    await asyncio.sleep(state.delay)
                    if chat:
                        choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": f"t{i} ", "finish_reason": None}
                    yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
                    if i == 0 and "MIDSTREAM" in prompt:
                        yield b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n'
                        return
                state.requests += 1
                last: dict[str, Any] = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
                yield b"data: " + json.dumps(last).encode() + b"\n\n"
                if include_usage:
                    tokens = 2 * state.chunks
                    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
                    yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app
