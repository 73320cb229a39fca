"""A bounded, loopback-only load generator for a served model, and a handle on one `arcsplit serve` process.

    gen = LoadGen("http://127.0.0.1:8080", concurrency=8, max_requests=500, max_seconds=120)
    results = anyio.run(gen.run)

Each of ``concurrency`` workers sends one streaming chat completion at a time (optionally pausing between them)
until ``max_requests`` have started or ``max_seconds`` have passed. Every request is bounded by ``timeout``:
a request that hits it is a *hang* (outcome "timeout"); one that ends with a refused connection, an HTTP error
or a stream cut short is a clean *error*. Only 127.0.0.1 / ::1 / localhost are accepted.

``Served`` starts the real CLI (``python -m arcsplit serve ...``) in its own session with private state, runtime
and temp dirs, waits for /health, samples the supervisor's memory and open files, and after stop checks that no
process, port or temporary file is left behind. bench/soak.py, bench/faults.py and tests/test_faults.py use both.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ("127.0.0.1", "::1", "localhost")
PROMPTS = ("Name three colours.", "Count from one to ten.", "Write a short sentence about the sea.",
           "What is two plus two?", "Say hello in French.", "List some fruits.", "Describe a cat.", "Tell a joke.")


@dataclass(frozen=True)
class Result:
    start: float  # time.time()
    end: float
    outcome: str  # "ok" | "error" | "timeout"
    status: int | None
    error: str
    tokens: int
    ttft: float | None

    @property
    def seconds(self) -> float:
        return self.end - self.start


class LoadGen:
    """Keeps ``concurrency`` streaming requests in flight; bounded in count and time; loopback only."""

    def __init__(self, url: str, *, concurrency: int = 8, max_requests: int = 1000, max_seconds: float = 60.0,
                 timeout: float = 60.0, max_tokens: int = 16, pause: float = 0.0, seed: int = 0) -> None:
        host = urlparse(url).hostname
        if host not in LOOPBACK:
            raise ValueError(f"load generator only targets loopback, not {host!r}")
        if not (1 <= concurrency <= 64 and max_requests >= 1 and 0 < max_seconds <= 24 * 3600):
            raise ValueError("concurrency 1-64, max_requests >= 1, max_seconds up to a day")
        self.url = url.rstrip("/")
        self.concurrency, self.max_requests, self.max_seconds = concurrency, max_requests, max_seconds
        self.timeout, self.max_tokens, self.pause = timeout, max_tokens, pause
        self.results: list[Result] = []
        self.in_flight = 0
        self.active: dict[int, float] = {}  # id -> start time of the requests in flight
        self._started = 0
        self._stop = False
        self._rng = random.Random(seed)

    def stop(self) -> None:
        """Start no new request; the ones in flight finish (each within ``timeout``)."""
        self._stop = True

    async def run(self) -> list[Result]:
        deadline = time.monotonic() + self.max_seconds
        limits = httpx.Limits(max_connections=self.concurrency + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=5.0), limits=limits,
                                     trust_env=False) as client:
            async with anyio.create_task_group() as tg:
                for w in range(self.concurrency):
                    tg.start_soon(self._worker, client, deadline, w)
        return self.results

    async def _worker(self, client: httpx.AsyncClient, deadline: float, w: int) -> None:
        await anyio.sleep(w * 0.05)  # stagger the first wave
        while not self._stop and time.monotonic() < deadline and self._started < self.max_requests:
            self._started += 1
            r = await self.one(client)
            self.results.append(r)
            if r.outcome != "ok":
                await anyio.sleep(0.2)  # a refused connection returns at once: don't spin
            elif self.pause:
                await anyio.sleep(self.pause * (0.5 + self._rng.random()))

    async def one(self, client: httpx.AsyncClient) -> Result:
        body = {"messages": [{"role": "user", "content": self._rng.choice(PROMPTS)}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0.7}
        t0 = time.time()
        tokens, ttft, status, done = 0, None, None, False
        self.in_flight += 1
        key = self._started * 1000 + len(self.active)
        while key in self.active:
            key += 1
        self.active[key] = t0
        try:
            with anyio.fail_after(self.timeout):
                async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                    status = resp.status_code
                    if status != 200:
                        await resp.aread()
                        return Result(t0, time.time(), "error", status, f"HTTP {status}", 0, None)
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            continue
                        if "error" in chunk:
                            return Result(t0, time.time(), "error", status, f"stream error: {chunk['error']}"[:200],
                                          tokens, ttft)
                        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                            tokens += 1
                            if ttft is None:
                                ttft = time.time() - t0
            if not done:
                return Result(t0, time.time(), "error", status, "stream ended without [DONE]", tokens, ttft)
            return Result(t0, time.time(), "ok", status, "", tokens, ttft)
        except TimeoutError:
            return Result(t0, time.time(), "timeout", status, f"no end within {self.timeout} s", tokens, ttft)
        except httpx.HTTPError as exc:
            return Result(t0, time.time(), "error", status, f"{type(exc).__name__}: {exc}"[:200], tokens, ttft)
        finally:
            self.in_flight -= 1
            self.active.pop(key, None)


def summarize(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == "ok"]
    lat = sorted(r.seconds for r in ok)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None  # noqa: E731
    return {"requests": len(results), "ok": len(ok), "errors": sum(r.outcome == "error" for r in results),
            "timeouts": sum(r.outcome == "timeout" for r in results), "tokens": sum(r.tokens for r in ok),
            "p50_s": pct(0.5), "p95_s": pct(0.95), "max_s": lat[-1] if lat else None,
            "longest_failure_s": max((r.seconds for r in results if r.outcome != "ok"), default=None)}


# ---------------------------------------------------------------------------------------------------------------
# one `arcsplit serve` process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _exit_on_sigterm() -> None:
    """SIGTERM or SIGHUP to the bench raise SystemExit, so the ``finally`` that stops each Served runs: a serve runs in
    a session of its own, and a bench killed by the default action left it serving. The exit unwinds every ``with``
    (a netns harness's too, whose own handler, when set after this one, cleans up and then calls this one)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if getattr(previous, "_stops_served", False):
            continue

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            raise SystemExit(128 + signum)

        handler._stops_served = True  # type: ignore[attr-defined]
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave the signal as it is
            return


@dataclass
class Served:
    """`arcsplit serve MODEL --backend cpu` as a real subprocess with private dirs; see the module docstring."""

    model: Path
    gpus: str = "0,1"
    cpu_memory: int = 1024
    parallel: int = 4
    ctx: int = 4096
    extra_serve: tuple[str, ...] = ()
    llama_args: tuple[str, ...] = ()
    layout: Path | None = None  # serve a layout's cards (several hosts: issue 15) instead of --gpus/--cpu-memory
    cache: Path | None = None  # arcsplit's cache dir shared across runs (steady state); None: a private one
    runtime: Path | None = None  # ARCSPLIT_RUNTIME_DIR (control sockets: their paths must be short); None: base's
    port: int = field(default_factory=free_port)
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="arcsplit-served-")))
    proc: subprocess.Popen[bytes] | None = None
    seen_pids: dict[int, tuple[float, str]] = field(default_factory=dict)  # every descendant ever seen
    seen_ports: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tmpdir(self) -> Path:
        return self.base / "tmp"

    @property
    def state_dir(self) -> Path:
        return self.base / "state"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("state", "runtime", "tmp", "cache"):
            (self.base / name).mkdir(parents=True, exist_ok=True)
        env.update(ARCSPLIT_STATE_DIR=str(self.base / "state"), ARCSPLIT_RUNTIME_DIR=str(self.runtime or
                                                                                       self.base / "runtime"),
                   TMPDIR=str(self.tmpdir), PYTHONUNBUFFERED="1")
        # profiles are cached per user; a private cache keeps the run independent (the header read is ~0.1 s)
        env["ARCSPLIT_CACHE_DIR"] = str(self.cache or self.base / "cache")
        return env

    def argv(self) -> list[str]:
        cards = ["--layout", str(self.layout)] if self.layout else ["--gpus", self.gpus, "--cpu-memory",
                                                                     str(self.cpu_memory)]
        argv = [sys.executable, "-m", "arcsplit", "serve", str(self.model), "--backend", "cpu", *cards,
                "--port", str(self.port), "--parallel", str(self.parallel), "--ctx", str(self.ctx), *self.extra_serve]
        if self.llama_args:
            argv += ["--", *self.llama_args]
        return argv

    def start(self) -> None:
        _exit_on_sigterm()
        self.log = open(self.base / "serve.log", "wb")
        self.proc = subprocess.Popen(self.argv(), cwd=ROOT, env=self.env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 180.0, poll: float = 0.02) -> float:
        """Seconds until /health answered 200 (raises if the process exits or the time runs out). /health is asked
        every ``poll`` s (a refused connect costs microseconds); the descendants are noted every 0.2 s (a psutil
        walk costs more). A 0.2 s poll with the walk made every time to ready a multiple of ~0.24 s."""
        t0 = time.time()
        noted = 0.0
        with httpx.Client(timeout=1.0, trust_env=False) as client:  # one client: making one costs ~10 ms
            while time.time() - t0 < timeout:
                if time.time() - noted >= 0.2:
                    self.note_children()
                    noted = time.time()
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"arcsplit serve exited {self.proc.returncode}: {self.output()[-2000:]}")
                if self.healthy(client):
                    return time.time() - t0
                time.sleep(poll)
        raise RuntimeError(f"not ready after {timeout} s: {self.output()[-2000:]}")

    def healthy(self, client: httpx.Client | None = None) -> bool:
        try:
            if client is not None:
                return client.get(f"{self.url}/health").status_code == 200
            return httpx.get(f"{self.url}/health", timeout=1.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        try:
            return (self.base / "serve.log").read_text(errors="replace")
        except OSError:
            return ""

    def supervisor(self) -> psutil.Process:
        assert self.proc is not None
        return psutil.Process(self.proc.pid)

    def children(self) -> dict[str, psutil.Process]:
        """llama-server and rpc-servers by role name ("server", "rpc0", ...), from the live process tree."""
        out: dict[str, psutil.Process] = {}
        try:
            kids = self.supervisor().children(recursive=True)
        except psutil.Error:
            return out
        rpc = []
        for p in kids:
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            exe = Path(cmd[0]).name if cmd else ""
            if exe == "llama-server":
                out["server"] = p
            elif exe == "ggml-rpc-server":
                rpc.append((int(cmd[cmd.index("-p") + 1]) if "-p" in cmd else 0, p))
        # rpc0 is the first in --rpc order: read it from llama-server's argv
        order: list[int] = []
        if "server" in out:
            try:
                cmd = out["server"].cmdline()
                order = [int(e.rsplit(":", 1)[1]) for e in cmd[cmd.index("--rpc") + 1].split(",")] if "--rpc" in cmd else []
            except (psutil.Error, ValueError, IndexError):
                order = []
        for port, p in rpc:
            k = order.index(port) if port in order else len(order) + len(out)
            out[f"rpc{k}"] = p
        return out

    def note_children(self) -> None:
        try:
            kids = self.supervisor().children(recursive=True) if self.proc else []
        except psutil.Error:
            return
        for p in kids:
            try:
                self.seen_pids.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline()[:2])))
                for c in p.net_connections(kind="inet"):
                    if c.status == psutil.CONN_LISTEN:
                        self.seen_ports.add(c.laddr.port)
            except psutil.Error:
                pass

    def sample(self) -> dict[str, Any]:
        sup = self.supervisor()
        with sup.oneshot():
            return {"time": time.time(), "rss": sup.memory_info().rss, "fds": sup.num_fds(),
                    "threads": sup.num_threads(), "children": len(self.children())}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        self.note_children()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def leftovers(self, wait: float = 5.0) -> dict[str, list[Any]]:
        """After stop: live descendants, listening ports, temp files, state files still listing processes."""
        deadline = time.time() + wait
        while True:
            procs = []
            for pid, (ctime, cmd) in self.seen_pids.items():
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - ctime) < 0.05 and p.status() != psutil.STATUS_ZOMBIE:
                        procs.append(f"{pid} {cmd}")
                except psutil.Error:
                    pass
            ports = [p for p in sorted(self.seen_ports | {self.port}) if not port_free(p)]
            temps = [str(p) for p in self.tmpdir.rglob("*")] if self.tmpdir.exists() else []
            temps += [str(p) for p in self.state_dir.rglob("*.tmp")]
            states = []
            for f in self.state_dir.rglob("state.json"):
                try:
                    if json.loads(f.read_text()).get("processes"):
                        states.append(str(f))
                except (OSError, ValueError):
                    states.append(f"{f} (unreadable)")
            if not (procs or ports or temps or states) or time.time() > deadline:
                return {"processes": procs, "ports": ports, "temp_files": temps, "state_files": states}
            time.sleep(0.2)

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def demo_model() -> Path:
    sys.path.insert(0, str(ROOT))
    from arcsplit.demo import ensure_demo_model

    return Path(ensure_demo_model())
