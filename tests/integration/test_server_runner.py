"""The engine's background thread on its own (no HTTP): admission, abort, graceful shutdown."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tests.integration.serving import GatedEngine, tiny_engine, wait_until
from verispec.config import SamplingParams
from verispec.errors import InputError
from verispec.server.runner import EngineRunner, QueueFullError, ShuttingDownError

PROMPT = [1, 2, 3]


def test_shutdown_lets_requests_finish_within_the_grace_period() -> None:
    engine = tiny_engine(max_len=128)

    async def main() -> None:
        runner = EngineRunner(engine)
        runner.start()
        handle = await runner.submit("a", PROMPT, SamplingParams(temperature=0, max_tokens=30))
        await runner.shutdown(grace_seconds=60)
        final = await handle.result()
        assert final.finish_reason == "length" and len(final.token_ids) == 30
        assert not runner.alive
        with pytest.raises(ShuttingDownError):
            await runner.submit("b", PROMPT, SamplingParams())

    asyncio.run(main())
    assert not engine.has_unfinished()


def test_shutdown_aborts_what_is_left_after_the_grace_period() -> None:
    engine = tiny_engine(max_len=128, cls=GatedEngine)

    async def main() -> None:
        runner = EngineRunner(engine)
        runner.start()
        params = SamplingParams(max_tokens=100, logit_bias={256: -100.0})  # no early EOS
        handle = await runner.submit("a", PROMPT, params)
        engine.gate.clear()
        stopping = asyncio.ensure_future(runner.shutdown(grace_seconds=0.1))
        await asyncio.sleep(0.3)
        engine.gate.set()
        await stopping
        final = await handle.result()
        assert final.finish_reason == "abort" and "shutting down" in (final.error or "")
        assert len(final.token_ids) < 100
        assert not runner.alive

    asyncio.run(main())
    assert not engine.has_unfinished() and not engine.cache.active_slots


def test_begin_shutdown_aborts_requests_past_the_deadline_and_tells_them() -> None:
    engine = tiny_engine(max_len=512)

    async def main() -> None:
        runner = EngineRunner(engine)
        runner.start()
        params = SamplingParams(max_tokens=480, logit_bias={256: -100.0})  # no early EOS
        handle = await runner.submit("a", PROMPT, params)
        runner.begin_shutdown(grace_seconds=0.2)  # what a SIGINT / SIGTERM does in `verispec serve`
        final = await handle.result()
        assert final.finish_reason == "abort" and "shutting down" in (final.error or "")
        assert 0 < len(final.token_ids) < 480 and runner.alive
        await runner.shutdown()
        assert not runner.alive

    asyncio.run(main())
    assert not engine.has_unfinished()


def test_admission_is_bounded_and_errors_come_back_to_the_caller() -> None:
    engine = tiny_engine(max_batch=1, max_len=128, cls=GatedEngine)

    async def main() -> None:
        runner = EngineRunner(engine, max_queue=1)
        runner.start()
        with pytest.raises(InputError, match="outside the vocabulary"):
            await runner.submit("bad", [1, 9999], SamplingParams())
        assert runner.num_live == 0
        engine.gate.clear()  # the thread blocks in its next step: adds stay unacknowledged
        first = await runner.submit("a", PROMPT, SamplingParams(max_tokens=50))
        assert await asyncio.to_thread(engine.blocked.wait, 10.0)  # the thread now sits in a step
        second = asyncio.ensure_future(runner.submit("b", PROMPT, SamplingParams(max_tokens=50)))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await runner.submit("c", PROMPT, SamplingParams())
        second.cancel()  # the caller went away before its request was acknowledged: it is aborted
        with pytest.raises(asyncio.CancelledError):
            await second
        first.abort()
        assert runner.num_live == 0
        engine.gate.set()
        await asyncio.to_thread(wait_until, lambda: not engine.has_unfinished(), 10.0, "aborts")
        handle = await runner.submit("d", PROMPT, SamplingParams(temperature=0, max_tokens=4))
        assert len((await handle.result()).token_ids) == 4
        await runner.shutdown()

    asyncio.run(main())
    assert not engine.cache.active_slots
