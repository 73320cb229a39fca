"""Locust's user for bench/loadtool.py: streaming OpenAI chat completions against `arcsplit serve`.

Runs inside the bench's own locust venv (bench/loadtool.py makes it), so it imports only locust and the standard
library. The prompts, max_tokens and temperature come from bench/loadgen.py through LOADTOOL_BODY so both tools
send the same requests; each request is also appended to LOADTOOL_TRACE (one JSON line: start, end, outcome,
tokens, ttft) so its latencies can be summarised the way bench/loadgen.py's are, beside locust's own table.

Locust times a ``stream=True`` request only until the response headers arrive (its own test, locustio/locust
locust/test/test_client.py test_streaming_response), and llama-server sends the headers of a streamed completion
before the first token; so the HTTP call is recorded as "chat: headers" and the whole stream, to [DONE], is fired
as a request event of its own, "chat: whole stream", which is the row to read in Locust's table.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, constant, task

BODY = json.loads(os.environ["LOADTOOL_BODY"])  # {"prompts": [...], "max_tokens": N, "temperature": T}
TRACE = os.environ["LOADTOOL_TRACE"]


class ChatUser(HttpUser):
    wait_time = constant(0)

    @task
    def chat(self) -> None:
        body = {"messages": [{"role": "user", "content": random.choice(BODY["prompts"])}], "stream": True,
                "max_tokens": BODY["max_tokens"], "temperature": BODY["temperature"]}
        t0 = time.time()
        tokens, ttft, done, outcome = 0, None, False, "error"
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat: headers", timeout=BODY.get("timeout", 60)) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
            else:
                for raw in resp.iter_lines():
                    line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                        tokens += 1
                        ttft = ttft if ttft is not None else time.time() - t0
                if done:
                    outcome = "ok"
                    resp.success()
                else:
                    resp.failure("stream ended without [DONE]")
        end = time.time()
        self.environment.events.request.fire(
            request_type="POST", name="chat: whole stream", response_time=(end - t0) * 1000, response_length=tokens,
            exception=None if outcome == "ok" else RuntimeError("no [DONE]"), context={})
        with open(TRACE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"start": t0, "end": end, "outcome": outcome, "tokens": tokens,
                                 "ttft": ttft}) + "\n")
