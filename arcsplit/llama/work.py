"""What llama-server's task loop says it is doing, read from ``/slots`` (or ``/metrics``): one ``Work`` value. Pure.

Both endpoints are answered by the task loop (tools/server/server-context.cpp: a SLOT_GET or METRICS task), not by
the HTTP threads that answer ``/health``; while a decode runs, the queue's worker thread answers them
(server-queue.cpp ``yield_to_queue``), so they still answer when the decode hangs, and then their counters stand
still. The counters move only as it computes: each slot's ``n_prompt_tokens_processed`` (per decode of a batch of
the prompt, ``metrics_post_decode``) and ``next_token[0].n_decoded`` (per generated token), and ``/metrics``'s
``n_decode_total``, ``prompt_tokens_total``, ``tokens_predicted_total``. ``/slots`` is preferred: reading it
changes nothing, where each ``/metrics`` read resets the throughput gauges' averaging window (server-context.cpp
``metrics_reset_bucket``), which a user's own Prometheus scrape of llama-server would notice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PREFIX = "llamacpp:"


def parse_prometheus(text: str) -> dict[str, float]:
    """``name value`` lines of a Prometheus text exposition (no labels in llama-server's), prefix removed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or "{" in parts[0]:
            continue
        try:
            value = float(parts[1])
        except ValueError:
            continue
        if math.isfinite(value):
            out[parts[0].removeprefix(PREFIX)] = value
    return out


@dataclass(frozen=True)
class Work:
    """One answer of the task loop: how many requests it holds (``busy``: slots processing, plus requests waiting
    for a slot where the endpoint says) and ``done``, counters that change only when it computed something."""

    busy: int
    done: tuple[float, ...]


def from_slots(data: Any) -> Work | None:
    """``/slots``'s JSON list -> Work (None: not that shape). Per slot: its task, prompt tokens processed and tokens
    generated; a new task in a slot counts as a change too (the loop took it)."""
    if not isinstance(data, list):
        return None
    busy = 0
    done: list[float] = []
    for slot in data:
        if not isinstance(slot, dict):
            return None
        busy += bool(slot.get("is_processing"))
        nxt = slot.get("next_token")
        first = nxt[0] if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict) else {}
        done += [_num(slot.get("id_task")), _num(slot.get("n_prompt_tokens_processed")), _num(first.get("n_decoded"))]
    return Work(busy=busy, done=tuple(done))


def from_metrics(text: str) -> Work | None:
    """``/metrics``'s exposition -> Work (None: not llama-server's: no decode counter)."""
    m = parse_prometheus(text)
    if "n_decode_total" not in m:
        return None
    busy = int(m.get("requests_processing", 0)) + int(m.get("requests_deferred", 0))
    return Work(busy=busy, done=(m["n_decode_total"], m.get("prompt_tokens_total", 0.0),
                                 m.get("tokens_predicted_total", 0.0)))


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0
