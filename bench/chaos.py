"""Chaos across two hosts (issue 43): faults under load on a group split between this machine and host b, for each
way of reaching b; how long until it serves again, what failed meanwhile, what was lost after, what was left.

    sudo python bench/chaos.py [--runs 3] [--configs NAME ...] [--faults NAME ...] [--settle 60] [--minutes 45]
                               [--out FILE]

Host b is a network namespace with its own sshd (tests/_netns.py). `arcsplit serve` (bench/loadgen.py's Served) runs
the demo model in mode rpc with `--rpc-cache`: one CPU card here, b's card(s) there, while bench/loadgen.py keeps 2
streams in flight. Configurations: the default (per-run agent, forwards on the agent's ssh, one rpc-server per
card), `forwards = "own"` (each link its own `ssh -N -L`), `rpc_servers = "per-host"` (one rpc-server for b's two
cards) and `agent = "standing"` (b keeps `arcsplit node --listen` running; ssh runs `--attach`). Faults, each
--runs times, each once serving is steady:

- SIGKILL of each process on b: its rpc-server, its node agent (the standing agent's session, and `--attach`),
  its sshd session; SIGKILL of this machine's ssh client (the agent's session; with own forwards, a link's too);
- b's link down for 10 s (its veth end; packets vanish);
- 30 % packet loss on b for 10 s: `tc netem` where the kernel has sch_netem, else an nftables `numgen random`
  drop rule in b's namespace (said so in the table);
- b's weight-cache disk full (LLAMA_CACHE on a 4 MiB tmpfs, filled), then SIGKILL of b's rpc-server: the restart
  must serve with a cache it cannot write;
- b's rpc-server frozen (the cgroup freezer, tests/_freeze.py: alive, /health 200, as a hung card leaves it) until
  the progress watchdog restarts the group (docs/watchdog.md, its default --hang-after).

Per fault: recovery = from the fault to the end of the first request started after it that completes; requests
failed in the window (running at the fault or started before the recovery); requests lost after it (started after
the recovery and failed: must be 0). After each
configuration's serve stops: processes left here and on b (must be 0). Bounded: every wait has a limit and the
whole run stops after --minutes. Writes bench/results/chaos.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import anyio
import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from _freeze import frozen, unavailable as no_freezer  # noqa: E402
from _netns import NetHarness, unavailable  # noqa: E402
from _report import write_report  # noqa: E402
from loadgen import LoadGen, Served, demo_model  # noqa: E402
from multihost import mmm  # noqa: E402

CONFIGS = {"default": {}, "forwards own": {"forwards": "own"}, "per-host": {"rpc_servers": "per-host"},
           "standing agent": {"agent": "standing"}}
FAULTS = ("kill rpc-server on b", "kill node agent on b", "kill attach on b", "kill sshd session on b",
          "kill ssh client here", "kill link ssh here", "link down 10 s", "30% loss 10 s", "cache disk full on b",
          "freeze rpc-server on b")
CACHE_MIB = 4
# --focused: the default configuration takes every fault, the others the faults where they differ from it
FOCUS = {"forwards own": ("kill ssh client here", "kill link ssh here", "link down 10 s"),
         "per-host": ("kill rpc-server on b", "cache disk full on b", "freeze rpc-server on b"),
         "standing agent": ("kill node agent on b", "kill attach on b", "kill sshd session on b")}


@dataclass
class Outcome:
    recovery: float | None
    failed: int  # requests that failed in the window: in flight at the fault, or started before the recovery
    broken: int  # of those, requests in flight at the fault (the rest: the load's retries, one per 0.2 s per stream)
    lost: int
    note: str = ""


@dataclass
class Row:
    config: str
    fault: str
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: str = ""


def netem_available() -> bool:
    """Whether this kernel has sch_netem (`tc qdisc ... netem` in a scratch namespace)."""
    ns = f"arcs-{os.getpid()}-netemprobe"
    subprocess.run(["ip", "netns", "add", ns], capture_output=True)
    try:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss",
                            "1%"], capture_output=True)
        return r.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def on_b(net: NetHarness) -> dict[str, list[psutil.Process]]:
    """b's processes by kind (its sshd listener left out; the standing listener kept apart)."""
    kinds: dict[str, list[psutil.Process]] = {k: [] for k in ("rpc", "agent", "attach", "listener", "sshd", "other")}
    for p in net.processes("b"):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        name = Path(cmd[0]).name if cmd else ""
        kind = ("rpc" if name == "ggml-rpc-server" else "listener" if "--listen" in cmd else
                "attach" if "--attach" in cmd else "agent" if "--stdio" in cmd else
                "sshd" if name.startswith("sshd") else "other")
        kinds[kind].append(p)
    return kinds


def ssh_here(served: Served, link: bool) -> list[psutil.Process]:
    """This machine's ssh clients of the group: the agent's session (``link`` False) or a link's ``-N -L``."""
    out = []
    try:
        kids = served.supervisor().children(recursive=True)
    except psutil.Error:
        return out
    for p in kids:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if cmd and Path(cmd[0]).name == "ssh" and ("-L" in cmd) == link and "-O" not in cmd:
            out.append(p)
    return out


def kill_first(procs: list[psutil.Process]) -> str:
    if not procs:
        return "no such process"
    procs[0].send_signal(signal.SIGKILL)
    return ""


class Chaos:
    """One configuration's serve under load, and its faults."""

    def __init__(self, a: argparse.Namespace, net: NetHarness, served: Served, netem: bool) -> None:
        self.a, self.net, self.served, self.netem = a, net, served, netem
        self.gen = LoadGen(served.url, concurrency=2, max_requests=1_000_000, max_seconds=24 * 3600, timeout=60,
                           max_tokens=8)
        self.held = contextlib.ExitStack()  # a fault that lasts until the group recovers (a freeze), ended after it

    def inject(self, fault: str) -> tuple[str, Callable[[], None] | None]:
        """Start ``fault``: (why it cannot run here or "", how to end it after its 10 s, if it lasts)."""
        b = on_b(self.net)
        if fault == "kill rpc-server on b":
            return kill_first(b["rpc"]), None
        if fault == "kill node agent on b":
            return kill_first(b["agent"]), None
        if fault == "kill attach on b":
            return kill_first(b["attach"]), None
        if fault == "kill sshd session on b":
            return kill_first(b["sshd"]), None
        if fault == "kill ssh client here":
            return kill_first(ssh_here(self.served, link=False)), None
        if fault == "kill link ssh here":
            return kill_first(ssh_here(self.served, link=True)), None
        if fault == "link down 10 s":
            self.net.link("b", False)
            return "", lambda: self.net.link("b", True)
        if fault == "30% loss 10 s":
            return self.loss()
        if fault == "cache disk full on b":
            fill(self.net.host("b").dir / "llama-cache")
            return kill_first(b["rpc"]), None
        if fault == "freeze rpc-server on b":
            if (why := no_freezer()) or not b["rpc"]:
                return why or "no such process", None
            self.held.enter_context(frozen(b["rpc"][0].pid))  # b's pid space is this machine's
            return "", None
        raise ValueError(fault)

    def loss(self) -> tuple[str, Callable[[], None] | None]:
        peer = self.net.host("b").peer
        if self.netem:
            subprocess.run(self.net.ns_argv("b", ["tc", "qdisc", "add", "dev", peer, "root", "netem", "loss", "30%"]),
                           check=True)
            return "", lambda: subprocess.run(self.net.ns_argv("b", ["tc", "qdisc", "del", "dev", peer, "root"]))
        if not shutil.which("nft"):
            return "no sch_netem in this kernel and no nft", None
        rules = (f'table inet arcschaos {{\n chain in {{\n  type filter hook input priority 0;\n'
                 f'  iifname "{peer}" numgen random mod 100 < 30 drop\n }}\n}}\n')
        subprocess.run(self.net.ns_argv("b", ["nft", "-f", "-"]), input=rules.encode(), check=True)
        return "", lambda: subprocess.run(self.net.ns_argv("b", ["nft", "delete", "table", "inet", "arcschaos"]))

    async def steady(self, since: float, timeout: float = 180.0) -> float | None:
        """The end of the first request started at/after ``since`` that completed, once 2 more have; None: none
        within ``timeout``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            ok = sorted((r for r in self.gen.results if r.start >= since and r.outcome == "ok"), key=lambda r: r.end)
            if len(ok) >= 3:
                return ok[0].end
            await anyio.sleep(0.2)
        return None

    async def one(self, fault: str) -> Outcome | str:
        t0 = time.time()
        why, undo = self.inject(fault)
        if why:
            return why
        if undo is not None:
            await anyio.sleep(10)
            undo()
        if fault == "cache disk full on b":
            empty(self.net.host("b").dir / "llama-cache")  # after the restart that met it full
        done = await self.steady(t0)
        self.held.close()  # thawed (the restart killed it) and the cgroup removed
        if done is None:
            return Outcome(None, 0, 0, False, "not serving again within 180 s")
        await anyio.sleep(max(3.0, self.a.settle))  # ready time before the next fault; lost requests count below
        window = [r for r in self.gen.results if r.end >= t0 and r.start < done and r.outcome != "ok"]
        after = [r for r in self.gen.results if r.start >= done]
        return Outcome(done - t0, len(window), sum(r.start < t0 for r in window), sum(r.outcome != "ok" for r in after))

    async def run(self, faults: list[str], runs: int, deadline: float) -> list[Row]:
        rows = [Row("", f) for f in faults]
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.gen.run)
            if await self.steady(time.time()) is None:
                raise SystemExit(f"not steady under load: {self.served.output()[-800:]}")
            for row in rows:
                for _ in range(runs):
                    if time.time() > deadline:
                        row.skipped = row.skipped or "out of time (--minutes)"
                        break
                    got = await self.one(row.fault)
                    if isinstance(got, str):
                        row.skipped = got
                        break
                    row.outcomes.append(got)
                    print(f"  {row.fault}: {got}", flush=True)
                    if got.recovery is None:
                        break
            self.gen.stop()
            tg.cancel_scope.cancel()
        return rows


def fill(path: Path) -> None:
    with contextlib.suppress(OSError), open(path / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def empty(path: Path) -> None:
    (path / "filler").unlink(missing_ok=True)


@contextlib.contextmanager
def cache_tmpfs(net: NetHarness) -> Iterator[None]:
    """b's LLAMA_CACHE (its rpc-servers' weight cache) on a small tmpfs, unmounted on the way out."""
    path = net.host("b").dir / "llama-cache"
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CACHE_MIB}m,mode=0700", "arcschaos", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)])


@contextlib.contextmanager
def standing_listener(net: NetHarness, on: bool) -> Iterator[None]:
    """`arcsplit node --listen` in b's namespace (what its unit keeps running), stopped on the way out."""
    if not on:
        yield
        return
    p = subprocess.Popen(net.ns_argv("b", [str(net.host("b").arcsplit), "node", "--listen", "--backend", "cpu"]),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    time.sleep(3)
    try:
        yield
    finally:
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(20)
        if p.poll() is None:
            p.kill()


def layout(net: NetHarness, tmp: Path, name: str) -> Path:
    opts = CONFIGS[name]
    cards = [("", 300), ("b", 512), ("b", 512)] if opts.get("rpc_servers") else [("", 300), ("b", 1024)]
    path = net.layout(tmp / f"{name.replace(' ', '-')}.toml", cards, name=name,
                      forwards=opts.get("forwards", "shared"), rpc_servers=opts.get("rpc_servers", "per-card"))
    if opts.get("agent"):
        path.write_text(path.read_text().replace('link = "ssh"', f'link = "ssh"\nagent = "{opts["agent"]}"'))
    return path


def one_config(a: argparse.Namespace, net: NetHarness, tmp: Path, name: str, netem: bool,
               deadline: float) -> tuple[list[Row], dict[str, list[str]]]:
    """Serve ``name`` under its faults; (rows, what was left here and on b after the stop)."""
    faults = [f for f in a.faults if applies(name, f) and (not a.focused or f in FOCUS.get(name, FAULTS))]
    base = tmp / name.replace(" ", "-")
    base.mkdir()
    served = Served(Path(a.model), ctx=1024, parallel=2, layout=layout(net, tmp, name), base=base,
                    runtime=Path(tempfile.mkdtemp(prefix="rt", dir=tmp)),
                    extra_serve=("--mode", "rpc", "--threads", "1", "--rpc-cache", "--max-restarts", "50"))
    with standing_listener(net, name == "standing agent"):
        served.start()
        try:
            served.wait_ready(300)
            rows = anyio.run(Chaos(a, net, served, netem).run, faults, a.runs, deadline)
        finally:
            served.stop()
        left_b = wait_empty(net)
    left_here = served.leftovers(10)
    served.cleanup()
    for r in rows:
        r.config = name
    return rows, {"here": left_here["processes"], "b": left_b}


def applies(config: str, fault: str) -> bool:
    if fault == "kill attach on b":
        return config == "standing agent"
    if fault == "kill link ssh here":
        return config == "forwards own"
    return True


def wait_empty(net: NetHarness, timeout: float = 30.0) -> list[str]:
    """b's processes of the run (not the standing listener), once gone or after ``timeout``."""
    deadline = time.time() + timeout
    while True:
        left = [" ".join(p.cmdline()[:3]) for k, ps in on_b(net).items() if k != "listener" for p in ps
                if p.is_running()]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def report(rows: list[Row], left: dict[str, dict[str, list[str]]], netem: bool, minutes: float) -> str:
    lines = ["# Chaos across two hosts (bench/chaos.py)", "",
             f"Host b: a network namespace with its own sshd (tests/_netns.py) on this machine; demo model, mode rpc, "
             f"`--rpc-cache`, 2 streams of load (bench/loadgen.py). Packet loss: "
             f"{'tc netem' if netem else 'nftables numgen drop (this kernel has no sch_netem)'}. "
             f"Total {minutes:.1f} min. Command: `{shlex.join(['bench/chaos.py', *sys.argv[1:]])}`.", "",
             "| config | fault | runs | recovery s (min/median/max) | failed in window (in flight at the fault) | "
             "lost after |", "|---|---|---|---|---|---|"]
    for r in rows:
        done = [o.recovery for o in r.outcomes if o.recovery is not None]
        lines.append(f"| {r.config} | {r.fault} | {len(r.outcomes)} | {mmm(done) if done else '-'} | "
                     f"{sum(o.failed for o in r.outcomes)} ({sum(o.broken for o in r.outcomes)}) | "
                     f"{sum(o.lost for o in r.outcomes)} |"
                     + (f" {r.skipped}" if r.skipped else "")
                     + "".join(f" {o.note}" for o in r.outcomes if o.note))
    lines += ["", "| config | processes left here | processes left on b |", "|---|---|---|"]
    for name, where in left.items():
        lines.append(f"| {name} | {len(where['here'])} {where['here'] or ''} | {len(where['b'])} {where['b'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--minutes", type=float, default=45.0, help="stop starting faults after this long")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds ready after each recovery before the next fault: the supervisor's failure count "
                         "halves every 30 s ready, so faults closer together compound (docs/multihost.md)")
    ap.add_argument("--focused", action="store_true",
                    help="the default configuration takes every fault, the others only those where they differ")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.md"))
    a = ap.parse_args(argv)
    why = unavailable()
    if why:
        raise SystemExit(f"chaos: {why}")
    a.model = a.model or str(demo_model())
    t0 = time.time()
    deadline = t0 + a.minutes * 60
    netem = netem_available()
    rows: list[Row] = []
    left: dict[str, dict[str, list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="arcs-chaos-") as d:
        tmp = Path(d)
        llama = Path(os.environ["ARCSPLIT_LLAMA_DIR"]) if os.environ.get("ARCSPLIT_LLAMA_DIR") else None
        with NetHarness(tmp / "net", ("b",), llama) as net, cache_tmpfs(net):
            for name in a.configs:
                if time.time() > deadline:
                    break
                print(f"config {name} ...", flush=True)
                got, left[name] = one_config(a, net, tmp, name, netem, deadline)
                rows += got
    write_report(a.out, report(rows, left, netem, (time.time() - t0) / 60))
    lost = sum(o.lost for r in rows for o in r.outcomes)
    return 1 if lost or any(v["here"] or v["b"] for v in left.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
