"""llama-server's own view: /metrics (needs --metrics, which the supervisor passes) and /slots.

Metric names: llama.cpp's tools/server/server.cpp (the /metrics handler, ``llamacpp:*``). Speeds come from counter deltas between two scrapes:
decode t/s = Δtokens_predicted_total / Δtokens_predicted_seconds_total (the speed while generating),
and the same for the prompt. The gauges llama-server exports are averages since start, which hide a slowdown.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from ..llama.work import parse_prometheus  # the parser's owner: the watchdog reads /metrics too


def rates(prev: dict[str, float] | None, cur: dict[str, float]) -> dict[str, float | None]:
    """Prompt and generation tokens/s over the interval between two scrapes (None when nothing ran in it)."""

    def speed(tokens: str, seconds: str) -> float | None:
        if prev is None or tokens not in cur or seconds not in cur:
            return None
        dt = cur[seconds] - prev.get(seconds, 0.0)
        dn = cur[tokens] - prev.get(tokens, 0.0)
        if dt <= 0 or dn < 0:  # idle, or the server restarted and its counters started over
            return None
        return dn / dt

    return {"prompt_tps": speed("prompt_tokens_total", "prompt_seconds_total"),
            "gen_tps": speed("tokens_predicted_total", "tokens_predicted_seconds_total")}


def slot_summary(slots: Any) -> dict[str, int] | None:
    if not isinstance(slots, list):
        return None
    return {"total": len(slots), "busy": sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))}


class ServerSampler:
    """Scrapes one llama-server; keeps the previous scrape for the deltas."""

    def __init__(self, base_url: str, timeout: float = 1.5) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._prev: dict[str, float] | None = None
        self._client: httpx.AsyncClient | None = None

    async def sample(self) -> dict[str, Any] | None:
        """None when the server does not answer (loading, restarting)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, trust_env=False)
        try:
            r = await self._client.get(f"{self.base_url}/metrics")
            if r.status_code != 200:
                return None
            cur = parse_prometheus(r.text)
            slots = None
            s = await self._client.get(f"{self.base_url}/slots")
            if s.status_code == 200:
                slots = slot_summary(s.json())
        except (httpx.HTTPError, ValueError):
            return None
        prev = self._prev
        if prev is not None and cur.get("tokens_predicted_total", 0) < prev.get("tokens_predicted_total", 0):
            self._prev = None  # counters went back: a new llama-server
        out: dict[str, Any] = {
            "time": time.time(),
            "requests_processing": int(cur.get("requests_processing", 0)),
            "requests_deferred": int(cur.get("requests_deferred", 0)),
            "prompt_tokens_total": int(cur.get("prompt_tokens_total", 0)),
            "tokens_predicted_total": int(cur.get("tokens_predicted_total", 0)),
            **rates(self._prev, cur),
            "slots": slots,
        }
        self._prev = cur
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
