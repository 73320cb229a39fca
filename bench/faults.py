"""Faults under load: kill, stop and starve the serving group while 8-16 streams run; record how it recovers.

    python bench/faults.py [--concurrency 8] [--stall-timeout 10] [--only NAME ...] [--no-mount]

One real `arcsplit serve <demo model> --backend cpu --gpus 0,1` (mode rpc: two ggml-rpc-servers + llama-server)
runs the whole time under bench/loadgen.py's load. Faults, one after another, each once serving is steady:

- SIGKILL / SIGTERM of an rpc-server, SIGKILL / SIGTERM of llama-server;
- SIGSTOP of an rpc-server for longer than the stall timeout, then SIGCONT;
- the log disk full: the state dir (logs + state.json) is a small tmpfs, filled to the last byte for 20 s;
- the supervisor's port taken: llama-server is killed and its port bound by another program for 10 s.

For each: seconds until serving resumes (the first request *started after* the fault that completes), requests
that failed and whether they failed cleanly (an error; a request running into the client timeout is a hang),
and processes of the old generation still alive. After the final stop: processes, ports, temp files left.
Results go to bench/results/faults.md. Needs root for the tmpfs (else the disk fault is skipped).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import ROOT, LoadGen, Served, demo_model, summarize  # noqa: E402


@dataclass
class FaultResult:
    name: str
    at: float
    detail: str = ""
    resumed_s: float | None = None
    health_down_s: float | None = None
    failed: int = 0
    broken: int = 0  # of the failed: requests already running when the fault hit
    clean: int = 0
    hung: int = 0
    survived: int = 0  # requests running at the fault that still completed
    old_alive: list[str] = field(default_factory=list)
    restarts: int = 0
    note: str = ""


class Faults:
    def __init__(self, served: Served, gen: LoadGen, stall: float, settle: float, mount: bool) -> None:
        self.served, self.gen, self.stall, self.settle, self.mount = served, gen, stall, settle, mount
        self.results: list[FaultResult] = []
        self.broken = False
        self.health: list[tuple[float, bool]] = []

    # -- helpers --------------------------------------------------------------------------------------------

    async def health_poller(self) -> None:
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
            while True:
                try:
                    ok = (await client.get(f"{self.served.url}/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.health.append((time.time(), ok))
                await anyio.sleep(0.1)

    async def steady(self, timeout: float = 120.0) -> None:
        """Wait until 3 requests started in the last while have completed OK and all 3 children are up."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            self.served.note_children()
            recent = [r for r in self.gen.results if r.start > t0 and r.outcome == "ok"]
            if len(recent) >= 3 and len(self.served.children()) == 3:
                await anyio.sleep(self.settle)
                return
            await anyio.sleep(0.5)
        raise RuntimeError("serving did not become steady")

    def pids(self) -> dict[int, str]:
        return {p.pid: n for n, p in self.served.children().items()}

    async def measure(self, res: FaultResult, before: dict[int, str], window: float = 120.0) -> None:
        """Wait for the first request started after the fault to complete OK; then count failures around it."""
        t0 = res.at
        end = t0 + window
        while time.time() < end:
            ok = [r for r in self.gen.results if r.start >= t0 and r.outcome == "ok"]
            if ok:
                res.resumed_s = min(r.end for r in ok) - t0
                break
            await anyio.sleep(0.2)
        down = [t for t, h in self.health if t >= t0 and not h]
        res.health_down_s = (down[-1] - down[0]) if down else 0.0
        resumed_at = t0 + (res.resumed_s or window)
        # every request that was running at or started during the outage has ended (at worst at its timeout)
        limit = time.time() + self.gen.timeout + 5
        while time.time() < limit and any(s <= resumed_at for s in self.gen.active.values()):
            await anyio.sleep(0.2)
        around = [r for r in self.gen.results if r.end >= t0 - 0.5 and r.start <= resumed_at]
        res.failed = sum(r.outcome != "ok" for r in around)
        res.broken = sum(r.outcome != "ok" and r.start < t0 for r in around)
        res.clean = sum(r.outcome == "error" for r in around)
        res.hung = sum(r.outcome == "timeout" for r in around)
        res.survived = sum(r.outcome == "ok" and r.start < t0 for r in around)
        try:
            await self.steady()
        except RuntimeError:
            self.broken = True
            res.note = "serving did not come back within 120 s; the fault sequence stops here"
            return
        now = self.pids()
        for pid, name in before.items():
            try:
                p = psutil.Process(pid)
                if pid not in now and p.status() != psutil.STATUS_ZOMBIE:
                    res.old_alive.append(f"{name} {pid}")
            except psutil.Error:
                pass
        res.restarts = sum(1 for pid in before if pid not in now)

    # -- the faults -----------------------------------------------------------------------------------------

    async def kill(self, who: str, sig: int) -> FaultResult:
        before = self.pids()
        proc = self.served.children()[who]
        res = FaultResult(f"{signal.Signals(sig).name} {'llama-server' if who == 'server' else 'rpc-server'} "
                          f"({who})", time.time())
        os.kill(proc.pid, sig)
        await self.measure(res, before)
        return res

    async def sigstop(self, who: str = "rpc1") -> FaultResult:
        before = self.pids()
        proc = self.served.children()[who]
        hold = self.stall + 10
        res = FaultResult(f"SIGSTOP rpc-server ({who}) for {hold:.0f} s (stall timeout {self.stall:.0f} s)", time.time())
        os.kill(proc.pid, signal.SIGSTOP)
        await anyio.sleep(hold)
        restarted = proc.pid not in self.pids()
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        res.detail = ("the supervisor replaced the stopped group" if restarted else
                      "the supervisor did not notice (it watches exits, and the load stall timeout only applies "
                      "while loading); streams waited and resumed after SIGCONT")
        await self.measure(res, before)
        return res

    async def fill_disk(self, kill: bool = False) -> FaultResult:
        before = self.pids()
        res = FaultResult("log disk full for 20 s" + (", rpc-server SIGKILLed while full (restart must log)" if kill
                                                       else " (tmpfs under the state dir)"), time.time())
        filler = self.served.state_dir / "filler"
        written = 0
        with open(filler, "wb") as f:
            chunk = b"\0" * 65536
            try:
                while True:
                    f.write(chunk)
                    f.flush()
                    written += len(chunk)
            except OSError:
                pass
        # the last bytes too
        try:
            with open(filler, "ab") as f:
                while True:
                    f.write(b"\0")
                    f.flush()
        except OSError:
            pass
        if kill:
            os.kill(self.served.children()["rpc0"].pid, signal.SIGKILL)
        await anyio.sleep(20)
        logs = list(self.served.state_dir.rglob("server.log"))
        size_full = logs[0].stat().st_size if logs else 0
        filler.unlink()
        if self.served.proc.poll() is not None:
            res.detail = f"arcsplit serve itself exited {self.served.proc.returncode}: " + \
                self.served.output().strip().splitlines()[-1][:300]
            return res
        await self.measure(res, before)
        size_after = logs[0].stat().st_size if logs else 0
        res.detail = (f"filled {written / 2**20:.1f} MiB; logging resumed after space came back: "
                      f"{'yes' if size_after > size_full else 'no new lines yet'}")
        return res

    async def take_port(self) -> FaultResult:
        before = self.pids()
        server = self.served.children()["server"]
        res = FaultResult("supervisor's port taken for 10 s (llama-server killed, port bound by another program)",
                          time.time())
        os.kill(server.pid, signal.SIGKILL)
        sock = None
        t_end = time.time() + 5
        while sock is None and time.time() < t_end:
            try:
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the old connections sit in TIME_WAIT
                s.bind(("127.0.0.1", self.served.port))
                s.listen()
                sock = s
            except OSError:
                s.close()
                await anyio.sleep(0.01)
        res.detail = "port taken" if sock else "could not take the port (llama-server restarted first)"
        await anyio.sleep(10)
        if sock:
            sock.close()
        await self.measure(res, before, window=180)
        return res

    async def run(self, only: list[str] | None) -> None:
        plan: list[tuple[str, Any]] = [
            ("kill-rpc", lambda: self.kill("rpc0", signal.SIGKILL)),
            ("term-rpc", lambda: self.kill("rpc1", signal.SIGTERM)),
            ("kill-server", lambda: self.kill("server", signal.SIGKILL)),
            ("stop-rpc", self.sigstop),
            ("disk-full", self.fill_disk),
            ("disk-full-kill", lambda: self.fill_disk(kill=True)),
            ("port", self.take_port),
            ("term-server", lambda: self.kill("server", signal.SIGTERM)),  # last: it does not recover (see notes)
        ]
        await self.steady()
        for name, fn in plan:
            if only and name not in only:
                continue
            if name.startswith("disk-full") and not self.mount:
                continue
            print(f"fault {name} ...", flush=True)
            res = await fn()
            print(f"  {res}", flush=True)
            self.results.append(res)
            if self.served.proc.poll() is not None or self.broken:
                print("serving is gone: no more faults", flush=True)
                break


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    ap.add_argument("--stall-timeout", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=65.0,
                    help="steady seconds between faults; each halves the supervisor's failure count twice over "
                         "(RestartPolicy.half_life 30 s), so each fault starts from a count near 0 (backoff 1 s)")
    ap.add_argument("--only", nargs="*", help="run only these faults")
    ap.add_argument("--no-mount", action="store_true", help="skip the disk-full fault (needs root for a tmpfs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.md"))
    args = ap.parse_args()
    if not 8 <= args.concurrency <= 16:
        ap.error("--concurrency must be 8-16")

    served = Served(demo_model(), extra_serve=("--stall-timeout", str(args.stall_timeout), "--max-restarts", "20"))
    mount = False
    if not args.no_mount and os.geteuid() == 0:
        served.state_dir.mkdir(parents=True, exist_ok=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(served.state_dir)],
                               capture_output=True).returncode == 0
    served.start()
    gen = LoadGen(served.url, concurrency=args.concurrency, max_requests=10**6, max_seconds=3600,
                  timeout=args.timeout, max_tokens=args.max_tokens)
    faults = Faults(served, gen, args.stall_timeout, args.settle, mount)
    t0 = time.time()
    try:
        ready = served.wait_ready()
        print(f"ready in {ready:.1f} s", flush=True)

        async def go() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(faults.health_poller)
                tg.start_soon(gen.run)
                try:
                    await faults.run(args.only)
                finally:
                    gen.stop()
                    with anyio.move_on_after(args.timeout + 5):
                        while gen.in_flight:
                            await anyio.sleep(0.2)
                    tg.cancel_scope.cancel()

        anyio.run(go)
    finally:
        rc = served.stop(signal.SIGTERM)
        left = served.leftovers()
        if mount:
            subprocess.run(["umount", str(served.state_dir)], capture_output=True)
    summary = summarize(gen.results)
    _write(args, served, faults, summary, rc, left, time.time() - t0, mount)
    print(summary, left, rc)
    served.cleanup()
    over = [r for r in gen.results if r.seconds > args.timeout + 1]
    return 1 if summary["timeouts"] or over or any(left.values()) else 0


def _write(args, served, faults, summary, rc, left, elapsed, mount) -> None:  # noqa: ANN001
    lines = [
        "# Faults under load",
        "",
        f"`python bench/faults.py --concurrency {args.concurrency} --stall-timeout {args.stall_timeout:g}` "
        f"({time.strftime('%Y-%m-%d')}, 2-core VM, {elapsed / 60:.1f} min).",
        "",
        f"`arcsplit serve` of the demo model, `--backend cpu --gpus 0,1 --cpu-memory 1024 --parallel {served.parallel} "
        f"--ctx {served.ctx} --stall-timeout {args.stall_timeout:g}`: mode rpc, rpc0 + rpc1 + llama-server. "
        f"{args.concurrency} streaming clients (max {args.max_tokens} tokens, client timeout {args.timeout:g} s) run "
        "through every fault. *Resumed*: seconds from the fault to the end of the first request started after it "
        "that completed (it includes that request's own generation time, ~1-3 s here). *Failed*: requests "
        "running at or started during the outage that did not complete; *clean* = ended with an error (refused "
        "connection, HTTP 5xx, stream cut), *hung* = ran into the client timeout. *Old alive*: processes of the "
        "replaced group still running after recovery.",
        "",
        "| fault | resumed after | /health down | failed (broken mid-stream) | clean | hung | survived | group replaced "
        "| old alive |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in faults.results:
        lines.append(f"| {r.name} | {r.resumed_s:.1f} s | {r.health_down_s:.1f} s | {r.failed} ({r.broken}) | {r.clean} | {r.hung} "
                     f"| {r.survived} | {'yes' if r.restarts else 'no'} | {', '.join(r.old_alive) or 'none'} |"
                     if r.resumed_s is not None else
                     f"| {r.name} | did not resume | | {r.failed} ({r.broken}) | {r.clean} | {r.hung} | {r.survived} | | |")
    lines += [""] + [f"- {r.name}: {r.detail}" for r in faults.results if r.detail]
    lines += [f"- {r.name}: {r.note}" for r in faults.results if r.note]
    if not mount:
        lines.append("- log disk full: skipped (needs root to mount a tmpfs)")
    lines += [
        "",
        f"All requests: {summary['requests']:,}, ok {summary['ok']:,}, clean errors {summary['errors']}, hangs "
        f"(client timeout) {summary['timeouts']}; longest failed request {summary['longest_failure_s'] or 0:.1f} s "
        f"(client timeout {args.timeout:g} s).",
        "",
        f"Stop (SIGTERM) after the faults: exit {rc}; left behind: processes {left['processes'] or 'none'}, "
        f"listening ports {left['ports'] or 'none'}, temp files {left['temp_files'] or 'none'}, state files "
        f"listing processes {left['state_files'] or 'none'}.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
