"""A node agent's client end for tests: the process (`arcsplit node --stdio`, or `--attach` as ssh runs it) and its
JSON-lines events, read on a thread so that every wait has a timeout."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from typing import Any, Mapping, Sequence

import psutil


class NodeClient:
    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=dict(env) if env is not None else None)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def send(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()

    def wait(self, ev: str, name: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """The next ``ev`` event (of process ``name``, if given); every event read on the way lands in ``seen``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.events.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(msg)
            if msg.get("ev") == ev and (name is None or msg.get("name") == name):
                return msg
        raise AssertionError(f"no {ev} event for {name or 'any process'} in {timeout} s; seen {self.seen[-10:]}")


def gone(pid: int, timeout: float = 15.0) -> bool:
    """Whether process ``pid`` has exited (or does within ``timeout`` seconds)."""
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True
