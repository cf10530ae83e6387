"""A connection pool for many concurrent calls to few engines: requests spread round-robin over several
httpx pools (``ShardedTransport``).

Why: httpcore's pool walks every connection it holds on each request's start and end, asking each idle
one whether its socket is readable (a dict of socket attributes, ``getpeername`` and ``poll`` per
connection), so a worker with a few hundred connections to its engines spent a third of its CPU in that
walk with short turns (docs/measurements/cost.md). With ``SHARDS`` pools each walk sees a share of the
connections; a request still reuses an open connection whenever its pool has an idle one.

Invariant: a request goes to exactly one pool and is answered by it; closing the transport closes every pool.
"""

from __future__ import annotations

import itertools

import httpx

SHARDS = 8
"""Pools a transport spreads its requests over (each walk sees about 1/SHARDS of the connections)."""


class ShardedTransport(httpx.AsyncBaseTransport):
    """``shards`` HTTP transports with the same limits; each request goes to the next one in turn."""

    def __init__(self, limits: httpx.Limits, shards: int = SHARDS) -> None:
        if shards < 1:
            raise ValueError(f"shards: {shards} (at least 1)")
        self.pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._turn = itertools.cycle(self.pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await next(self._turn).handle_async_request(request)

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()
