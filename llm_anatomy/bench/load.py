"""How requests are sent in a level: a closed loop (a fixed number of streams, each sending its next request
as soon as its last one ends) or an open loop (requests arriving as a Poisson process at a given rate,
whatever the server's pace)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .client import RequestResult
from .datasets import Prompt

Send = Callable[[Prompt], Awaitable[RequestResult]]


@dataclass(frozen=True)
class Level:
    """One point of a sweep: `concurrency` streams (closed loop) or `request_rate` requests/s (open loop)."""

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency is not None else f"rate {self.request_rate:g}/s"

    @property
    def x(self) -> float:
        return self.concurrency if self.concurrency is not None else self.request_rate


@dataclass
class LevelRun:
    results: list[RequestResult]
    duration_s: float  # first send to last response
    max_in_flight: int
    send_span_s: float  # first send to last send (an open loop's achieved rate: (n - 1) / span)
    client_cpu: float  # this process's CPU time / wall time over the level (1.0 = one core busy)


def poisson_arrivals(n: int, rate: float, seed: int | str) -> list[float]:
    """Send times (s from the level's start) of n requests: the first at 0, then exponential gaps drawn from a
    generator seeded with `seed`, scaled (as vLLM's benchmark scales them) so that the last is at (n - 1) / rate:
    the level's mean rate is the rate asked for, whatever the draw, and the gaps keep their Poisson shape."""
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        times.append(t)
    scale = (n - 1) / rate / t if t > 0 else 1.0
    return [x * scale for x in times]


class _InFlight:
    def __init__(self):
        self.now = self.max = 0

    async def run(self, send: Send, prompt: Prompt) -> RequestResult:
        self.now += 1
        self.max = max(self.max, self.now)
        try:
            return await send(prompt)
        finally:
            self.now -= 1


async def run_level(level: Level, prompts: list[Prompt], send: Send, seed: int,
                    on_done: Callable[[RequestResult], None] | None = None) -> LevelRun:
    """Send every prompt once, as the level says; `on_done` is called with each result as it comes."""
    in_flight = _InFlight()
    results: list[RequestResult] = []
    sends: list[float] = []

    async def one(prompt: Prompt) -> None:
        sends.append(time.perf_counter())
        result = await in_flight.run(send, prompt)
        results.append(result)
        if on_done is not None:
            on_done(result)

    wall0, cpu0 = time.perf_counter(), time.process_time()
    if level.concurrency is not None:
        queue = iter(prompts)

        async def stream() -> None:
            for prompt in queue:  # the streams share one iterator: each prompt is sent once
                await one(prompt)

        await asyncio.gather(*(stream() for _ in range(min(level.concurrency, len(prompts)))))
    else:
        loop = asyncio.get_running_loop()
        t0, tasks = loop.time(), []
        for prompt, at in zip(prompts, poisson_arrivals(len(prompts), level.request_rate, seed)):
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.gather(*tasks)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    first = min(r.start_s for r in results)
    last = max(r.end_s or r.start_s for r in results)
    return LevelRun(results, last - first, in_flight.max, max(sends) - min(sends), cpu / wall if wall > 0 else 0.0)
