"""The server's engine loop (``phaseserve.server.loop.EngineLoop``) over a model-free stub backend: every submitted
request streams all its tokens to its handle, and ``batch_wait_s`` gathers submissions that arrive close together
into the first step (without it, the loop steps as soon as the first one is in)."""

from __future__ import annotations

import asyncio

import pytest

from phaseserve.bench.http_cost import StubBackend
from phaseserve.engine import Request
from phaseserve.server.loop import EngineLoop


class Recording(StubBackend):
    def __init__(self):
        super().__init__(step_s=0.02)
        self.batches: list[int] = []  # requests running at each step

    def advance(self) -> None:
        self.batches.append(len(self.running))
        super().advance()


async def _serve(batch_wait_s: float, gap_s: float, n: int = 3, tokens: int = 4) -> tuple[list[int], list[list[int]]]:
    backend = Recording()
    loop = EngineLoop(backend, batch_wait_s=batch_wait_s)
    try:
        handles = []
        for i in range(n):
            handles.append(loop.submit(Request(id=f"r{i}", prompt=[1, 2, 3], max_tokens=tokens)))
            await asyncio.sleep(gap_s)
        got = []
        for h in handles:
            toks: list[int] = []
            while True:
                up = await asyncio.wait_for(h.get(), 10)
                toks += up.tokens
                if up.final:
                    break
            got.append(toks)
        return backend.batches, got
    finally:
        loop.close()


def test_without_a_wait_the_first_step_runs_the_first_request_alone():
    batches, got = asyncio.run(_serve(0.0, gap_s=0.1))
    assert batches[0] == 1
    assert got == [[97] * 4] * 3


def test_batch_wait_gathers_close_arrivals_into_the_first_step():
    batches, got = asyncio.run(_serve(0.2, gap_s=0.01))
    assert batches[0] == 3 and len(batches) == 4  # all three prefilled and finished together
    assert got == [[97] * 4] * 3


def test_a_negative_batch_wait_is_refused():
    with pytest.raises(ValueError, match="batch_wait_s"):
        EngineLoop(StubBackend(0.0), batch_wait_s=-1.0)
