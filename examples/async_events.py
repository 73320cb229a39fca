"""The anyio twin: serve, print the group's events while a request runs, then stop.

    python examples/async_events.py [MODEL.gguf]
"""

import socket
import sys

import anyio
import httpx

import arcsplit
from arcsplit.demo import ensure_demo_model


def free_port() -> int:
    """A port free now on this machine (the example's own; arcsplit's default is 8080)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(model: str) -> None:
    async with arcsplit.aserve(model, gpus=[0, 1], backend="cpu", cpu_memory_mib=1024, ctx=2048, threads=1,
                               port=free_port()) as server:
        print("serving", server.url)
        seen: list[str] = []

        async def watch() -> None:
            async for ev in server.events():
                if ev.kind == "group":
                    seen.append(ev.data["state"])
                    print("group:", ev.data["state"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await server.restart()
            with anyio.fail_after(10):  # let the watcher see the group's last transition
                while not seen or seen[-1] != "ready":
                    await anyio.sleep(0.01)
            async with httpx.AsyncClient(timeout=120) as http:
                r = await http.post(f"{server.url}/completion", json={"prompt": "Hello", "n_predict": 4})
                print("tokens:", r.json()["tokens_predicted"])
            tg.cancel_scope.cancel()
        print("group states seen:", " -> ".join(seen))


anyio.run(main, str(sys.argv[1] if len(sys.argv) > 1 else ensure_demo_model()))
