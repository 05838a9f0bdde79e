"""--anatomy: each request's server-side anatomy (an llm-anatomy server names it in the `x-anatomy-id` header
and serves it at GET /v1/anatomy/{id}) joined to the client's timing of the same request.

The anatomies are fetched after the level, not during it, so that fetching them adds no load to what is
measured; the server keeps its newest --keep-anatomies, so a level larger than that loses its first ones
(counted, with the reason).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from ..anatomy import Anatomy
from .client import RequestResult, get_text
from .metrics import distribution_ms

FETCH_CONCURRENCY = 16


async def _fetch(session: aiohttp.ClientSession, base_url: str, anatomy_id: str) -> dict | str:
    """The anatomy's summary (Anatomy.summary()), or why not."""
    text, why = await get_text(session, f"{base_url}/v1/anatomy/{anatomy_id}", "GET /v1/anatomy",
                               {404: "not in the server's store (older than its --keep-anatomies newest)"})
    if text is None:
        return why
    try:
        return Anatomy.from_json(text).summary()
    except (ValueError, KeyError, TypeError) as e:
        return f"not an anatomy this version reads ({str(e)[:100]})"


async def fetch_summaries(session: aiohttp.ClientSession, base_url: str, ids: list[str]) -> dict[str, dict | str]:
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def one(anatomy_id: str):
        async with gate:
            return anatomy_id, await _fetch(session, base_url, anatomy_id)

    return dict(await asyncio.gather(*(one(i) for i in ids)))


def ttft_split(sent_unix: float | None, client_ttft_s: float, server: dict) -> tuple[float | None, float | None]:
    """(arrival_ms, delivery_ms) of one request, its client TTFT around the server's (`server`: its anatomy or
    summary, with `started_at_unix` and `ttft_ms`). `arrival_ms`: from the client's send to the server's start
    (its request received), on the wall clocks of both; `delivery_ms`: the rest of the client's TTFT after the
    arrival and the server's own TTFT (the first token's way back: the server's HTTP side, SSE, the client)."""
    if sent_unix is None or not server.get("started_at_unix"):
        return None, None
    arrival = (server["started_at_unix"] - sent_unix) * 1e3
    ttft = server.get("ttft_ms")
    return arrival, None if ttft is None else client_ttft_s * 1e3 - arrival - ttft


def arrival_split(sent_unix: float | None, handed_unix: float | None,
                  arrival_ms: float | None) -> tuple[float | None, float | None]:
    """(client_send_ms, to_server_ms): a request's arrival (ttft_split) cut where the client handed it to its
    connection. The first part is the client's own (its event loop, its connection pool), the second the network's
    and the server's (its accept, its HTTP parsing, its event loop) up to the server's start."""
    if sent_unix is None or handed_unix is None or arrival_ms is None:
        return None, None
    client = (handed_unix - sent_unix) * 1e3
    return client, arrival_ms - client


def _row(r: RequestResult, s: dict) -> dict:
    """One request seen from both sides (ms), its TTFT split as ttft_split says, its arrival as arrival_split."""
    prefill, batching = s.get("prefill") or {}, s.get("batching") or {}
    arrival, delivery = ttft_split(r.sent_unix, r.ttft_s, s)
    client_send, to_server = arrival_split(r.sent_unix, r.handed_unix, arrival)
    return {
        "id": s["id"],
        "client_ttft_ms": r.ttft_s * 1e3, "server_ttft_ms": s.get("ttft_ms"),
        "arrival_ms": arrival, "client_send_ms": client_send, "to_server_ms": to_server, "delivery_ms": delivery,
        "client_e2e_ms": r.e2e_s * 1e3, "server_e2e_ms": s.get("e2e_ms"),
        "queue_ms": s.get("queue_ms"), "prefill_ms": prefill.get("gpu_ms"),
        "prefill_batch_size": prefill.get("batch_size"),
        "mean_batch_size": batching.get("mean_batch_size"), "max_batch_size": batching.get("max_batch_size"),
        "preemptions": batching.get("preemptions"), "output_tokens": s.get("output_tokens"),
        "energy_j": s.get("energy_j"),
    }


def joined_view(results: list[RequestResult], summaries: dict[str, dict | str]) -> dict:
    """Per request rows and their distributions. `ttft_gap_ms` is client TTFT - server TTFT: the network, HTTP
    and SSE framing, and whatever the server did before its own clock started. It splits into `arrival_ms`
    (before the server's clock started) and `delivery_ms` (after its first token) when the two wall clocks agree:
    one host, or hosts whose clocks are synchronized well below the figures (a skew shows in both, opposite); the
    arrival into `client_send_ms` and `to_server_ms` (arrival_split)."""
    rows, missing = [], Counter()
    for r in results:
        if not r.ok:
            continue
        s = summaries.get(r.anatomy_id) if r.anatomy_id else "no x-anatomy-id header"
        if isinstance(s, dict):
            rows.append(_row(r, s))
        else:
            missing[s or "not fetched"] += 1

    def values(key: str) -> list[float]:
        return [row[key] / 1e3 for row in rows if row[key] is not None]  # distribution_ms takes seconds

    gaps = [(row["client_ttft_ms"] - row["server_ttft_ms"]) / 1e3 for row in rows if row["server_ttft_ms"] is not None]
    batch = [row["mean_batch_size"] for row in rows if row["mean_batch_size"] is not None]
    energy = [row["energy_j"] for row in rows if row["energy_j"] is not None]
    tokens = sum(row["output_tokens"] or 0 for row in rows if row["energy_j"] is not None)
    return {
        "joined": len(rows), "missing": dict(missing.most_common()),
        "server_ttft_ms": distribution_ms(values("server_ttft_ms")),
        "ttft_gap_ms": distribution_ms(gaps),
        "arrival_ms": distribution_ms(values("arrival_ms")),
        "client_send_ms": distribution_ms(values("client_send_ms")),
        "to_server_ms": distribution_ms(values("to_server_ms")),
        "delivery_ms": distribution_ms(values("delivery_ms")),
        "queue_ms": distribution_ms(values("queue_ms")),
        "prefill_ms": distribution_ms(values("prefill_ms")),
        "mean_batch_size": sum(batch) / len(batch) if batch else None,
        "max_batch_size": max((row["max_batch_size"] for row in rows if row["max_batch_size"] is not None),
                              default=None),
        "preemptions": sum(row["preemptions"] or 0 for row in rows),
        "j_per_output_token": sum(energy) / tokens if energy and tokens else None,
        "requests": rows,
    }
