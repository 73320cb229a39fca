"""A stand-in for ``ssh -N -L`` where no sshd runs: listen on LISTEN, pipe each connection to TARGET.

    python tests/_tcp_forward.py 127.0.0.1:L 127.0.0.1:R

Only tests/test_remote_group.py uses it, to run a link member without ssh; tests/test_multihost*.py run the real
``ssh -N -L`` into a network namespace.
"""

from __future__ import annotations

import sys

import anyio
from anyio.abc import SocketStream


async def main(listen: str, target: str) -> None:
    lhost, lport = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)

    async def handle(client: SocketStream) -> None:
        async with client:
            try:
                server = await anyio.connect_tcp(thost, int(tport))
            except OSError:
                return
            async with server, anyio.create_task_group() as tg:
                async def pump(a: SocketStream, b: SocketStream) -> None:
                    try:
                        async for chunk in a:
                            await b.send(chunk)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()  # one side closed: close both, as ssh does

                tg.start_soon(pump, client, server)
                tg.start_soon(pump, server, client)

    listener = await anyio.create_tcp_listener(local_host=lhost, local_port=int(lport))
    await listener.serve(handle)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
