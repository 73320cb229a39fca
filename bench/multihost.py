"""Several hosts (issue 15): one host vs two "hosts" over a veth link, through SSH and direct, measured for real.

    sudo python bench/multihost.py [--runs 3] [--reps 3] [--n-predict 32] [--kills 3] [--model PATH] [--out FILE]
                                   [--forwards shared|own] [--kex ALG] [--idle-session] [--machine-rc]

Host b is a Linux network namespace joined by a veth pair and reached over Debian's OpenSSH (tests/_netns.py: a
throwaway sshd, key and known_hosts; root only). Every configuration serves the same model in mode rpc on two CPU
cards of the same size with `arcsplit serve` (the CLI, a fresh process group per run; order rotated per run):
- one host: both rpc-servers here (`--gpus 0,1`);
- two hosts, ssh: one rpc-server here, one on b bound to b's 127.0.0.1, reached through an ssh forward (on the node
  agent's own connection; `--forwards own`: an `ssh -N -L` member with its own login);
- two hosts, direct: the one on b binds b's veth address and llama-server dials it (link = "direct").
Per run: time to ready (`arcsplit serve` start to /health 200: planning, ssh, node agent, loads) and
bench/throughput.py's prefill (512-token prompt), decode and 4-stream t/s (its measurers, medians of --reps after
a warm-up), greedy token ids compared with one host's. Then recovery: SIGKILL of the rpc-server of the second
card (on b for two hosts) --kills times, the seconds until a completion returns the same greedy tokens again,
with and without the weight cache (`serve --rpc-cache`). Writes bench/results/multihost.md.

arcsplit's bytecode is compiled first (compileall), as `pip install` does.

Both "hosts" share this one machine: ssh, sshd and both rpc-servers compete with llama.cpp for the same cores, and
the "link" is a veth pair (no wire, no NIC). `--idle-session` adds one host's group with an unused ssh session to
b's node agent beside it: what b's side of a start costs these shared cores, which a real b pays on its own. Host
b's login shell reads Debian's stock ~/.bashrc, as a fresh host's would (tests/_netns.py); `--machine-rc` keeps
this machine's own, whose `pyenv init` costs every ssh command ~0.3 s.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from _netns import NetHarness, unavailable  # noqa: E402
from _report import write_report  # noqa: E402
from loadgen import Served  # noqa: E402
from throughput import (STREAMS, build_line, greedy, long_prompt, machine, measure_decode,  # noqa: E402
                        measure_prefill, measure_streams)

from arcsplit.demo import ensure_demo_model  # noqa: E402

CONFIGS = {"one host": None, "two hosts, ssh": "ssh", "two hosts, direct": "direct"}
KEX = "ssh-kex"  # --kex: two hosts over SSH, with a key exchange named in the host's ssh_config
IDLE = "idle-session"  # --idle-session: one host, plus an ssh session to b's node agent that serve does not use
IDLE_NAME = "one host + idle session to b"
DECODE_TARGET, READY_TARGET = 0.90, 1.2  # issue 15: over SSH, of the same split on one host


@dataclass
class Run:
    ready: float
    prefill: float
    decode: float
    streams: float
    greedy: list[list[int]]
    argv: dict[str, str] = field(default_factory=dict)
    opened: float = float("nan")  # serve's own figure for b: its ssh's start to the node agent's first message


def opened_s(s: Served) -> float:
    """What serve printed for host b's session (ssh login and node agent); NaN on one host."""
    found = re.findall(r"host b \([^)]*\): ssh login and node agent in ([0-9.]+) s", s.output())
    return float(found[0]) if found else float("nan")


def served(a: argparse.Namespace, net: NetHarness, tmp: Path, link: str | None, extra: tuple[str, ...] = (),
           parallel: int = STREAMS) -> Served:
    n = len(list(tmp.glob("layout-*.toml")))
    cards = [("", a.cards[0]), ("" if link in (None, IDLE) else "b", a.cards[1])]
    layout = net.layout(tmp / f"layout-{n}.toml", cards, link="ssh" if link in (None, KEX, IDLE) else link,
                        name=link or "one host", forwards=a.forwards)
    if link == KEX:  # the same host through an ssh_config that names the key exchange (what a user's would)
        kex_config = tmp / "ssh_config_kex"
        if not kex_config.exists():
            kex_config.write_text(net.ssh_config.read_text().replace(
                "\n  BatchMode yes", f"\n  BatchMode yes\n  KexAlgorithms {a.kex}"))
        layout.write_text(layout.read_text().replace(str(net.ssh_config), str(kex_config)))
    base = tmp / f"served-{n}"
    base.mkdir()
    return Served(Path(a.model), ctx=a.ctx, parallel=parallel, layout=layout, base=base, cache=tmp / "cache",
                  extra_serve=("--mode", "rpc", "--threads", str(a.threads), *extra))


@contextlib.contextmanager
def running(s: Served) -> Iterator[Served]:
    """``s`` started; stopped and its dirs removed on the way out, whatever happened."""
    s.start()
    try:
        yield s
    finally:
        s.stop()
        s.cleanup()


def commands(s: Served, net: NetHarness) -> dict[str, str]:
    """What ran, for the report: llama-server and every rpc-server (here and on b), and the ssh processes."""
    out = {"arcsplit": shlex.join(["arcsplit", *s.argv()[3:]])}
    kids = s.supervisor().children(recursive=True) + net.processes("b", "ggml-rpc-server")
    for p in kids:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        name = Path(cmd[0]).name if cmd else ""
        if name in ("llama-server", "ggml-rpc-server", "ssh"):  # ssh: the node session (carrying shared forwards)
            where = " (on b)" if p in net.processes("b") else ""
            out[f"{name}{where} {len(out)}"] = shlex.join(cmd)
    return out


@contextlib.contextmanager
def idle_session(net: NetHarness, on: bool) -> Iterator[None]:
    """``on``: what a second host costs this machine's shared cores without serving anything: an ssh login to b
    and its node agent (as serve's session: the agent's start, its imports, its stats), kept open until the run
    ends. On two real hosts b's share of it runs on b's own cores."""
    if not on:
        yield
        return
    p = subprocess.Popen(net.ssh_argv("b", [str(net.host("b").arcsplit), "node", "--stdio"]), stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        assert p.stdin is not None
        p.stdin.close()  # EOF: the agent exits, then ssh
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure(a: argparse.Namespace, net: NetHarness, tmp: Path, link: str | None) -> Run:
    s = served(a, net, tmp, link)
    with running(s), idle_session(net, link == IDLE):  # the session starts with serve, as serve's own would
        ready = s.wait_ready(300)
        if a.ready_only:  # a model too big to time prefill/decode on this machine in a bench's time
            with httpx.Client(timeout=a.timeout) as client:
                tokens = greedy(client, s.url, a.n_predict)
            nan = float("nan")
            return Run(ready, nan, nan, nan, tokens, commands(s, net), opened_s(s))
        with httpx.Client(timeout=a.timeout) as client:
            prompt = long_prompt(client, s.url, 512)
            p, d, st = [], [], []
            for i in range(a.reps + 1):  # 0: warm-up
                x = (measure_prefill(client, s.url, prompt), measure_decode(client, s.url, a.n_predict),
                     measure_streams(s.url, a.n_predict, a.timeout))
                if i:
                    p.append(x[0])
                    d.append(x[1])
                    st.append(x[2])
            tokens = greedy(client, s.url, a.n_predict)
        return Run(ready, statistics.median(p), statistics.median(d), statistics.median(st), tokens, commands(s, net),
                   opened_s(s))


def victim(s: Served, net: NetHarness, link: str | None) -> psutil.Process:
    """The second card's rpc-server: here (rpc1) on one host, on b otherwise."""
    if link is None:
        return s.children()["rpc1"]
    (p,) = net.processes("b", "ggml-rpc-server")
    return p


@dataclass
class Recovery:
    seconds: list[float] = field(default_factory=list)
    victim_argv: str = ""  # the killed rpc-server's command line (does it run with the weight cache, -c?)


def recovery(a: argparse.Namespace, net: NetHarness, tmp: Path, link: str | None, cache: bool) -> Recovery:
    s = served(a, net, tmp, link, ("--max-restarts", "50", *(("--rpc-cache",) if cache else ())), parallel=1)
    rec = Recovery()
    out = rec.seconds
    with running(s):
        s.wait_ready(300)
        with httpx.Client(timeout=a.timeout) as client:
            before = greedy(client, s.url, 8)
            for _ in range(a.kills):
                v = victim(s, net, link)
                rec.victim_argv = shlex.join(v.cmdline())
                t0 = time.monotonic()
                v.send_signal(signal.SIGKILL)
                v.wait(30)
                while True:
                    if time.monotonic() - t0 > 300:
                        raise SystemExit(f"{link or 'one host'}: not serving 300 s after the kill: {s.output()[-800:]}")
                    try:
                        if s.healthy() and greedy(client, s.url, 8) == before:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
                out.append(time.monotonic() - t0)
                print(f"  recovery {link or 'one host'}{' (weight cache)' if cache else ''}: {out[-1]:.2f} s",
                      flush=True)
    return rec


def mmm(xs: list[float], digits: int = 2) -> str:
    if not xs or any(x != x for x in xs):  # none, or not measured (--ready-only: NaN)
        return "-"
    return f"{min(xs):.{digits}f} / **{statistics.median(xs):.{digits}f}** / {max(xs):.{digits}f}"


def report(a: argparse.Namespace, runs: dict[str, list[Run]], rec: dict[tuple[str, bool], Recovery],
           build: str, mach: str, cmdline: str) -> str:
    base = runs["one host"]
    ref = base[0].greedy if base else None

    def med(name: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in runs[name])

    lines = ["# Several hosts: one host vs two over a veth link (SSH and direct)", "",
             f"- Build: {build}", f"- Machine: {mach}. **Both \"hosts\" share this one machine**: host b is a network "
             "namespace joined by a veth pair, so ssh, sshd and both rpc-servers compete with llama.cpp for the same "
             "cores, and the link has no wire or NIC; these are the costs of the route and its processes, not of a LAN. "
             + ("Host b's login shell reads this machine's own ~/.bashrc (--machine-rc)." if a.machine_rc else
                "Host b's login shell reads Debian's stock ~/.bashrc (a fresh host's; this machine's own runs "
                "`pyenv init`, ~0.3 s per ssh command: --machine-rc)."),
             f"- Model: `{Path(a.model).name}`; mode rpc on two CPU cards of {a.cards[0]} and {a.cards[1]} MiB (a "
             f"layout; one rpc-server each; on two hosts the second card is on b), ctx {a.ctx}, -np {STREAMS}, "
             f"threads {a.threads} per process.",
             f"- Command: `{cmdline}`",
             f"- {a.runs} runs, every configuration a fresh `arcsplit serve` per run (order rotated); per run the "
             f"median of {a.reps} repetitions after a warm-up: prefill = 512-token prompt, decode = n_predict "
             f"{a.n_predict}, {STREAMS} streams = {STREAMS} concurrent decode requests (bench/throughput.py's "
             "measurers); time to ready = `arcsplit serve` start to /health 200, of which `serve`'s own figure "
             "for b's session (its ssh's start to the node agent's first message; it overlaps the planning here). "
             "Cells: min / **median** / max over runs.",
             "- Repeated starts, as a user's are: one arcsplit cache for every run, after one untimed start per "
             "configuration, which indexed the GGUF for the rpc-servers' weight cache here and on b (once per "
             "file version); those first starts took " + ", ".join(f"{k} {v:.2f} s" for k, v in a.first_start.items())
             + ".", "",
             "| configuration | time to ready s | of which ssh login + node agent s | prefill t/s | decode t/s | "
             "4 streams t/s | ready / one host | prefill / one host | decode / one host | 4 streams / one host | "
             "greedy = one host |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        if not rs:
            lines.append(f"| {name} | failed | | | | | | | | | |")
            continue
        ratios = [f"{med(name, k) / med('one host', k):.2f}x" if base and med(name, k) == med(name, k) else "-"
                  for k in ("ready", "prefill", "decode", "streams")]
        same = sum(r.greedy == ref for r in rs)
        eq = "(reference)" if name == "one host" else f"{'yes' if same == len(rs) else 'NO'} ({same}/{len(rs)} runs)"
        lines.append(f"| {name} | {mmm([r.ready for r in rs])} | {mmm([r.opened for r in rs])} | "
                     f"{mmm([r.prefill for r in rs], 1)} | "
                     f"{mmm([r.decode for r in rs])} | {mmm([r.streams for r in rs])} | {' | '.join(ratios)} | {eq} |")
    lines.append("")
    if base and runs["two hosts, ssh"]:
        d = med("two hosts, ssh", "decode") / med("one host", "decode")
        r = med("two hosts, ssh", "ready") / med("one host", "ready")
        decode = ("decode not measured (--ready-only)" if a.ready_only else
                  f"over SSH decode is {d:.2f}x of one host (target >= {DECODE_TARGET:.2f}x: "
                  f"{'meets' if d >= DECODE_TARGET else 'misses'})")
        lines += [f"Result: {decode}, time to ready {r:.2f}x (target <= "
                  f"{READY_TARGET:.1f}x: {'meets' if r <= READY_TARGET else 'misses'}).", ""]
        if runs.get(IDLE_NAME):
            i = med(IDLE_NAME, "ready") / med("one host", "ready")
            lines += [f"One host with an idle session to b beside it (an ssh login and b's node agent, unused: b's "
                      f"side of a start on these shared cores) was ready in {i:.2f}x one host's time; two hosts "
                      f"over SSH took {med('two hosts, ssh', 'ready') / med(IDLE_NAME, 'ready'):.2f}x of that. "
                      "On two machines b's side runs on b's cores, and only the ssh client's part of the login stays "
                      "here.", ""]
    lines += [f"Greedy check: {len(ref or [])} prompts x {a.n_predict} tokens at temperature 0, token ids of every "
              "run compared with the first one-host run's.", ""]
    if rec:
        lines += recovery_lines(a, rec)
    lines += ["Every run (s; t/s):", ""]
    for name, rs in runs.items():
        for k, r in enumerate(rs, 1):
            lines.append(f"- {name}, run {k}: ready {r.ready:.2f}" + ("" if a.ready_only else
                         f"; prefill {r.prefill:.1f}; decode {r.decode:.2f}; {STREAMS} streams {r.streams:.2f}"))
    lines += ["", "The commands of each configuration's first run:", ""]
    for name, rs in runs.items():
        if rs:
            lines += [f"- {name} / {k.rsplit(' ', 1)[0]}: `{v}`" for k, v in rs[0].argv.items()]
    return "\n".join(lines) + "\n"


def recovery_lines(a: argparse.Namespace, rec: dict[tuple[str, bool], Recovery]) -> list[str]:
    lines = [f"## Recovery after SIGKILL of the second card's rpc-server ({a.kills} kills per row, -np 1)", "",
              "Seconds from the kill until a completion returns the same greedy tokens again (the group restarts "
              "in order: rpc-servers here and on b, the forward, llama-server, which loads the weights again).", "",
              "| configuration | `serve --rpc-cache` | killed rpc-server runs with `-c` | serving again s "
              "(min / median / max) | each |", "|---|---|---|---|---|"]
    for (name, cache), r in rec.items():
        c = "yes" if " -c" in f"{r.victim_argv} " else "no"
        lines.append(f"| {name} | {'on' if cache else 'off'} | {c} | {mmm(r.seconds)} | "
                     f"{', '.join(f'{x:.2f}' for x in r.seconds)} |")
    lines += ["", "The node agent starts b's rpc-servers with the weight cache (`-c`) whether or not `--rpc-cache` "
              "is given (issue 15's design), so on two hosts the flag only changes the card here, not the killed "
              "one. Both \"hosts\" share one filesystem (b reads the same GGUF: its rpc-server seeds from it, "
              "patch 0006), but b's weight cache is its own directory (its LLAMA_CACHE).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the demo Gemma 3 270M)")
    ap.add_argument("--gb", type=float, default=None,
                    help="instead of --model: bench/time_to_ready.py's synthetic F16 Llama of about this many GB "
                         "(big tensors 2-22 MiB, as in real models: the weights a host reads from its own copy)")
    ap.add_argument("--ready-only", action="store_true",
                    help="time to ready and greedy identity only (no prefill/decode/streams: for a big model)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs per recovery row (0: no recovery rows)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--cards", default="300,1024",
                    help="the two cards' MiB (first here, second on b; default 300,1024: the demo model's layers "
                         "split about half and half, the output on the second card)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--forwards", choices=("shared", "own"), default="shared",
                    help="the ssh forwards: on the node agent's connection (default) or each its own ssh login")
    ap.add_argument("--kex", metavar="ALG",
                    help="one more configuration: two hosts over SSH whose ssh_config names this key exchange "
                         "(e.g. curve25519-sha256: OpenSSH before 9.9 defaults to sntrup761x25519-sha512, which "
                         "costs each login more CPU)")
    ap.add_argument("--idle-session", action="store_true",
                    help="one more configuration: one host while an ssh session to b's node agent runs beside it, "
                         "unused (what b's side of a start costs these shared cores, which a real b pays on its own)")
    ap.add_argument("--machine-rc", action="store_true",
                    help="host b's login shell reads this machine's own ~/.bashrc (default: Debian's stock one, as "
                         "on a fresh host; every ssh command runs the login shell's rc)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multihost.md"))
    a = ap.parse_args(argv)
    if min(a.runs, a.reps, a.n_predict) < 1 or a.kills < 0:
        ap.error("--runs, --reps and --n-predict must be at least 1, --kills at least 0")
    sizes = [x for x in a.cards.split(",") if x.strip().isdigit() and int(x) > 0]
    if len(sizes) != 2 or len(a.cards.split(",")) != 2:
        ap.error(f"--cards {a.cards!r} is not two sizes in MiB (write it like 300,1024)")
    a.cards = [int(x) for x in sizes]
    a.first_start = {}
    why = unavailable()
    if why:
        raise SystemExit(f"multihost: cannot make a second host here: {why}")
    if a.gb is not None:
        from time_to_ready import load_model

        a.model = str(load_model(a.gb))
    a.model = a.model or str(ensure_demo_model())
    # arcsplit as installed: pip compiles a package's bytecode, an editable checkout (under PYTHONDONTWRITEBYTECODE,
    # as on this project's CI machines) does not, which costs every Python start here and on b 0.1-0.2 s of
    # compiling, in every configuration alike
    compileall.compile_dir(str(ROOT / "arcsplit"), quiet=1)
    cmdline = shlex.join(["python", "bench/multihost.py", *(argv if argv is not None else sys.argv[1:])])
    build, mach = build_line(None, "cpu"), machine("cpu")
    from arcsplit.llama.locate import find_llama

    llama_dir = find_llama(None, backend="cpu").bin_dir
    os.environ["ARCSPLIT_LLAMA_DIR"] = str(llama_dir)  # Served gives every run a private cache dir: name the build
    configs = {**CONFIGS, **({f"two hosts, ssh, {a.kex}": KEX} if a.kex else {}),
               **({IDLE_NAME: IDLE} if a.idle_session else {})}
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    rec: dict[tuple[str, bool], Recovery] = {}
    with tempfile.TemporaryDirectory(prefix="arcsplit-multihost-") as tmpdir, \
            NetHarness(Path(tmpdir) / "net", ("b",), llama_dir, machine_rc=a.machine_rc) as net:
        tmp = Path(tmpdir)
        names = list(configs)
        # Repeated starts of one model, as a user's are: one untimed start per configuration first, which indexes
        # the GGUF for the rpc-servers' weight cache here and on b (once per file version; its cost is said apart)
        for name in names:
            with running(served(a, net, tmp, configs[name])) as warm:
                a.first_start[name] = first = warm.wait_ready(600)
            print(f"first start {name:<18} ready {first:6.2f} s (untimed: indexes the model once)", flush=True)
        for i in range(a.runs):
            for k in range(len(names)):
                name = names[(i + k) % len(names)]
                r = measure(a, net, tmp, configs[name])
                runs[name].append(r)
                print(f"run {i + 1} {name:<18} ready {r.ready:6.2f} s  prefill {r.prefill:7.1f}  decode "
                      f"{r.decode:6.2f}  {STREAMS} streams {r.streams:6.2f} t/s", flush=True)
        if a.kills:
            for name in ("one host", "two hosts, ssh"):
                for cache in (False, True):
                    rec[(name, cache)] = recovery(a, net, tmp, CONFIGS[name], cache)
    write_report(a.out, report(a, runs, rec, build, mach, cmdline))
    ref = runs["one host"][0].greedy
    return 0 if all(r.greedy == ref for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
