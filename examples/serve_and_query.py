"""Serve a model across two cards from a script, ask it something, watch a restart.

    python examples/serve_and_query.py [MODEL.gguf]     # default: the demo model on two CPU cards
"""

import socket
import sys

import httpx

import arcsplit
from arcsplit.demo import ensure_demo_model


def free_port() -> int:
    """A port free now on this machine (the example's own; arcsplit's default is 8080)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


model = sys.argv[1] if len(sys.argv) > 1 else ensure_demo_model()

with arcsplit.serve(model, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=2048, threads=1,
                    port=free_port()) as server:
    print("serving", server.url, "mode", server.mode, "split", server.plan.tensor_split)
    r = httpx.post(f"{server.url}/completion", json={"prompt": "The capital of France is", "n_predict": 8,
                                                     "temperature": 0}, timeout=120)
    print("answer:", r.json()["content"].strip())
    server.restart()
    print("after restart:", server.status()["state"], "generation", server.status()["generation"])
