"""Prefill, decode and N-stream speed of a running llama-server, and its time to first token, over its HTTP API.

Shared by ``arcsplit tune`` and bench/throughput.py. Prefill: a prompt of exactly N tokens, one token predicted,
no prompt cache (``timings.prompt_per_second``); time to first token: that same request's wall time on the
client's clock, which also holds what the server does per request outside the prompt's compute (its prompt cache,
a sampler set up on the card); decode: a short prompt, n_predict tokens, eos ignored
(``timings.predicted_per_second``); streams: N concurrent decode requests, total predicted tokens / wall time.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

DECODE_PROMPT = "Write a long story about a lighthouse keeper and the sea."
FILLER = ("In the year {i}, the council of the river towns met to discuss the price of grain, the state of the "
          "bridges and the long dispute about fishing rights downstream. ")


def long_prompt(client: httpx.Client, url: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of ordinary text, through the model's own tokenizer."""
    text, i = "", 0
    while True:
        text += FILLER.format(i=1500 + i)
        i += 1
        if i % 8 == 0:
            toks = client.post(f"{url}/tokenize", json={"content": text}).json()["tokens"]
            if len(toks) >= n:
                return toks[:n]


def complete(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(f"{url}/completion", json={"temperature": 0, "cache_prompt": False, **body})
    r.raise_for_status()
    return r.json()


def timed(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """A /completion answer and its wall time on the client's clock, in ms: with n_predict 1, the time to first token
    a user sees (the host prompt cache's work before the prompt included, which the server's timings leave out)."""
    t0 = time.perf_counter()
    r = complete(client, url, body)
    return r, (time.perf_counter() - t0) * 1000


def measure_prefill(client: httpx.Client, url: str, prompt: list[int]) -> float:
    return prefill_and_ttft(client, url, prompt)[0]


def prefill_and_ttft(client: httpx.Client, url: str, prompt: list[int]) -> tuple[float, float]:
    """(prompt t/s by the server's timings, time to first token in ms by the client's clock) of one request."""
    r, ms = timed(client, url, {"prompt": prompt, "n_predict": 1})
    return float(r["timings"]["prompt_per_second"]), ms


def measure_decode(client: httpx.Client, url: str, n_predict: int) -> float:
    r = complete(client, url, {"prompt": DECODE_PROMPT, "n_predict": n_predict, "ignore_eos": True})
    return float(r["timings"]["predicted_per_second"])


def measure_streams(url: str, n_predict: int, timeout: float, streams: int = 4) -> float:
    """``streams`` concurrent decode requests (one per slot): total predicted tokens / wall time."""
    tokens = [0] * streams
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams + 1)

    def one(k: int) -> None:
        try:
            with httpx.Client(timeout=timeout) as c:
                barrier.wait()
                r = complete(c, url, {"prompt": f"{DECODE_PROMPT} (part {k + 1})", "n_predict": n_predict,
                                      "ignore_eos": True})
                tokens[k] = int(r["tokens_predicted"])
        except BaseException as exc:  # reported below; a thread must not die silently
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(tokens) / wall


@dataclass(frozen=True)
class Figures:
    """Medians over the repetitions that fit the budget (after one warm-up), in tokens/s; ``ttft`` in ms."""

    prefill: float
    decode: float
    streams: float
    reps: int
    ttft: float


def measure_all(client: httpx.Client, url: str, budget_s: float, prompt_tokens: int = 256, n_predict: int = 32,
                streams: int = 4, timeout: float = 120.0) -> Figures:
    """Prefill, decode and ``streams`` streams, repeated while ``budget_s`` lasts (at least one counted repetition
    after the warm-up, so a slow route costs more than its budget rather than going unmeasured)."""
    prompt = long_prompt(client, url, prompt_tokens)
    t0 = time.monotonic()
    p: list[float] = []
    d: list[float] = []
    s: list[float] = []
    t: list[float] = []
    for i in range(100):
        one = time.monotonic()
        fp, ft = prefill_and_ttft(client, url, prompt)
        fd = measure_decode(client, url, n_predict)
        fs = measure_streams(url, n_predict, timeout, streams) if streams > 1 else fd
        if i:
            p.append(fp)
            d.append(fd)
            s.append(fs)
            t.append(ft)
        spent = time.monotonic() - t0
        if i and spent + (time.monotonic() - one) > budget_s:
            break
    return Figures(statistics.median(p), statistics.median(d), statistics.median(s), len(p), statistics.median(t))
