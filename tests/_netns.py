"""Several "hosts" on one machine, for real: Linux network namespaces joined to this one by veth pairs, each
running Debian's OpenSSH server on a throwaway key and config, for the tests and bench of issue 15.

The main host is this process's own namespace; every remote host is a namespace ``arcs-<pid>-<seq><name>`` with a veth
pair (``10.77.N.1`` here, ``10.77.N.2`` there, a /30 of our own), its loopback up, and ``sshd -D -e`` listening
on its veth address only. An ssh_config (``Host <name>``: HostName, Port, User root, IdentityFile,
IdentitiesOnly, UserKnownHostsFile, StrictHostKeyChecking yes, BatchMode) reaches it, and ``<dir>/arcsplit-<name>``
runs this checkout's arcsplit there (its PYTHONPATH names this checkout) with private state dirs (namespaces
share the filesystem and PID space, so the "remote" arcsplit is the same venv and llama.cpp build).

Everything is removed on every exit path: ``close()`` (fixture finalizers), atexit, SIGTERM/SIGHUP, and at the
next start for namespaces whose creating process is gone (a SIGKILLed test session). Cleanup kills sshd and every
process left in the namespace (``ip netns pids``), then deletes the namespace, which takes its veth pair along.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import psutil

from _on_exit import on_exit

SSHD = "/usr/sbin/sshd"  # sshd must be started by its absolute path (it re-executes itself)
PREFIX = "arcs-"
SUBNET = "10.77"  # 10.77.N.0/30 per host: ours, never routed anywhere else
SSH_PORT = 2222
LOCK = Path("/tmp/arcsplit-netns.lock")  # one subnet chooser at a time across test sessions

_live: list["NetHarness"] = []
_seq = itertools.count()


def unavailable() -> str | None:
    """Why namespaces + sshd cannot run here (the reason a test skips with), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if not shutil.which("ip"):
        return "no `ip` (iproute2) to make network namespaces"
    if not os.access(SSHD, os.X_OK):
        return f"no {SSHD}: install Debian's openssh-server (scripts/_env.sh does when root and apt exist)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "no OpenSSH client (ssh, ssh-keygen)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    r = ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


def _delete_namespace(ns: str) -> None:
    """Kill every process in ``ns`` (SIGKILL: these are test processes), then delete it with its veth."""
    for _ in range(50):
        pids = ns_pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    ip("netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete namespaces of ours whose creating test process no longer exists (it was SIGKILLed), and the
    safety-net routes no live namespace of ours uses any more."""
    gone = []
    with _lock():
        for ns in namespaces():
            m = re.fullmatch(rf"{PREFIX}(\d+)-.+", ns)
            if m and not psutil.pid_exists(int(m.group(1))):
                _delete_namespace(ns)
                gone.append(ns)
        held = _subnets_with_addresses()
        for n in _unreachable_routes() - held:
            ip("route", "del", "unreachable", f"{SUBNET}.{n}.0/30", "metric", "1000", check=False)
    return gone


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _subnets_with_addresses() -> set[int]:
    used = set()
    for ns in [None, *namespaces()]:
        args = ["-n", ns] if ns else []
        for m in re.finditer(rf"inet {re.escape(SUBNET)}\.(\d+)\.", ip(*args, "-o", "-4", "addr", check=False).stdout):
            used.add(int(m.group(1)))
    return used


def _unreachable_routes() -> set[int]:
    out = ip("route", "show", "type", "unreachable", check=False).stdout
    return {int(m.group(1)) for m in re.finditer(rf"{re.escape(SUBNET)}\.(\d+)\.0/30", out)}


def _subnets_in_use() -> set[int]:
    return _subnets_with_addresses() | _unreachable_routes()


@dataclass(frozen=True)
class RemoteHost:
    """One remote "host": its namespace, link and the ssh files that reach it."""

    name: str  # the layout's host name (and the ssh_config Host alias)
    ns: str
    veth: str  # this side's end (in the main namespace)
    peer: str  # its end, inside ns
    main_addr: str  # 10.77.N.1: this side of the link
    addr: str  # 10.77.N.2: the host's address, where sshd listens
    ssh_port: int
    dir: Path  # its sshd config, keys, logs and arcsplit state

    @property
    def arcsplit(self) -> Path:
        """The command that runs arcsplit there: this venv's, with the host's own state dirs."""
        return self.dir / "arcsplit"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"


class NetHarness:
    """Namespaces + veth + sshd for ``hosts``; ``close()`` removes every trace (idempotent)."""

    def __init__(self, root: Path, hosts: tuple[str, ...] = ("b",), llama_dir: Path | None = None, *,
                 machine_rc: bool = False) -> None:
        self.root = root
        self.llama_dir = llama_dir
        self.machine_rc = machine_rc  # True: the login shell on each host reads this machine's own ~/.bashrc
        self.hosts: dict[str, RemoteHost] = {}
        self.sshd: dict[str, subprocess.Popen[bytes]] = {}
        self.ssh_config = root / "ssh_config"
        self.known_hosts = root / "known_hosts"
        self.client_key = root / "id_ed25519"
        self._names = hosts
        self._closed = False

    # ---- life cycle -------------------------------------------------------------------------------------------

    def start(self) -> "NetHarness":
        why = unavailable()
        if why:
            raise RuntimeError(why)
        sweep_stale()
        _live.append(self)
        on_exit(_cleanup_all)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        keygen(self.client_key, "arcsplit-test-client")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir (Debian)
        try:
            for name in self._names:
                self._add_host(name)
            self._write_client_files()
            for h in self.hosts.values():
                self._wait_sshd(h)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, name: str) -> None:
        with _lock():
            n = next(i for i in range(10, 250) if i not in _subnets_in_use())
            seq = next(_seq)  # several harnesses in one process (a test beside a fixture) get names of their own
            tag = f"{os.getpid() % 100000}{seq}{name}"[-9:]
            h = RemoteHost(name, f"{PREFIX}{os.getpid()}-{seq}{name}", f"arcs{tag}a", f"arcs{tag}b",
                           f"{SUBNET}.{n}.1", f"{SUBNET}.{n}.2", SSH_PORT, self.root / f"host-{name}")
            self.hosts[name] = h
            ip("netns", "add", h.ns)
            ip("-n", h.ns, "link", "set", "lo", "up")
            ip("link", "add", h.veth, "type", "veth", "peer", "name", h.peer, "netns", h.ns)
            ip("addr", "add", f"{h.main_addr}/30", "dev", h.veth)
            ip("-n", h.ns, "addr", "add", f"{h.addr}/30", "dev", h.peer)
            ip("link", "set", h.veth, "up")
            ip("-n", h.ns, "link", "set", h.peer, "up")
            # Never out of this machine: were the veth gone, 10.77.N.x must fail here, not follow the default route.
            ip("route", "add", "unreachable", f"{SUBNET}.{n}.0/30", "metric", "1000")
        h.dir.mkdir(mode=0o700)
        h.state_dir.mkdir(mode=0o700)
        keygen(h.dir / "ssh_host_ed25519_key", f"arcsplit-test-host-{name}")
        shutil.copy(self.client_key.with_suffix(".pub"), h.dir / "authorized_keys")
        (h.dir / "sshd_config").write_text("\n".join([
            f"ListenAddress {h.addr}:{h.ssh_port}",
            f"HostKey {h.dir / 'ssh_host_ed25519_key'}",
            f"AuthorizedKeysFile {h.dir / 'authorized_keys'}",
            f"PidFile {h.dir / 'sshd.pid'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the key files live under /tmp, which is world-writable (sticky)
            "AllowTcpForwarding yes",
            "X11Forwarding no",
            "PermitTunnel no",
            "PrintMotd no",
            "LogLevel VERBOSE",
            "",
        ]))
        env = {k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}
        (h.arcsplit).write_text(remote_wrapper(h, self.llama_dir, env))
        h.arcsplit.chmod(0o755)
        log = open(h.dir / "sshd.log", "wb")
        self.sshd[name] = subprocess.Popen(
            ["ip", "netns", "exec", h.ns, *self._stock_shell(h), SSHD, "-D", "-e", "-f", str(h.dir / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _stock_shell(self, h: RemoteHost) -> list[str]:
        """The argv prefix that gives the host's sshd a private mount namespace in which the login user's
        ``~/.bashrc`` is Debian's stock one (``/etc/skel/.bashrc``: it returns at once in a non-interactive shell).

        sshd runs every ssh command through the user's login shell, and bash reads ``~/.bashrc`` when sshd starts
        it. On this project's machines root's rc runs ``pyenv init`` (0.3 s per ssh command): a cost of this
        machine's setup, not of a second host, so by default a test host gets the rc a fresh Debian host has.
        ``machine_rc=True`` keeps this machine's. Nothing changes outside the namespace (the bind mount is private
        to it and goes with sshd)."""
        user = pwd.getpwnam("root")  # ssh_config_text logs in as root
        rc = Path(user.pw_dir) / ".bashrc"
        stock = Path("/etc/skel/.bashrc")
        if self.machine_rc or Path(user.pw_shell).name != "bash" or not rc.is_file() or not shutil.which("unshare"):
            return []
        if not stock.is_file():  # no Debian skeleton: an empty rc is what a stock non-interactive shell runs
            stock = h.dir / "stock.bashrc"
            stock.write_text("")
        return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(stock), str(rc)]

    def _write_client_files(self) -> None:
        lines = []
        for h in self.hosts.values():
            pub = (h.dir / "ssh_host_ed25519_key.pub").read_text().split()
            lines.append(f"[{h.addr}]:{h.ssh_port} {pub[0]} {pub[1]}")
        self.known_hosts.write_text("\n".join(lines) + "\n")
        self.ssh_config.write_text(ssh_config_text(self.hosts.values(), self.client_key, self.known_hosts))
        os.chmod(self.ssh_config, 0o600)

    def _wait_sshd(self, h: RemoteHost, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sshd[h.name].poll() is not None:
                raise RuntimeError(f"sshd in {h.ns} exited: {(h.dir / 'sshd.log').read_text()[-800:]}")
            if self.run(h.name, ["true"], timeout=10).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"sshd in {h.ns} did not answer within {timeout:.0f} s: "
                           f"{(h.dir / 'sshd.log').read_text()[-800:]}")

    def close(self) -> None:
        """Kill sshd and everything left in each namespace, delete the namespaces (and with them the veths)."""
        if self._closed:
            return
        self._closed = True
        for p in self.sshd.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for h in self.hosts.values():
            _delete_namespace(h.ns)
            ip("link", "del", h.veth, check=False)  # normally gone with the namespace
            ip("route", "del", "unreachable", f"{h.addr.rsplit('.', 1)[0]}.0/30", "metric", "1000", check=False)
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> "NetHarness":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- using it ---------------------------------------------------------------------------------------------

    def host(self, name: str = "b") -> RemoteHost:
        return self.hosts[name]

    def ssh_argv(self, name: str, command: list[str], known_hosts: Path | None = None) -> list[str]:
        """``ssh -F <config> NAME -- CMD`` (the remote words joined with shlex, as ssh joins them)."""
        extra = ["-o", f"UserKnownHostsFile={known_hosts}"] if known_hosts else []
        return ["ssh", "-F", str(self.ssh_config), *extra, name, shlex.join(command)]

    def run(self, name: str, command: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """``command`` on the host over ssh (the harness's config), output captured."""
        return subprocess.run(self.ssh_argv(name, command), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def ns_argv(self, name: str, argv: list[str]) -> list[str]:
        """Run ``argv`` inside the host's namespace directly (not through ssh): for checks and faults."""
        return ["ip", "netns", "exec", self.hosts[name].ns, *argv]

    def pids(self, name: str = "b") -> list[int]:
        """Processes alive in the host's namespace, the harness's own sshd listener left out (``ip netns exec``
        execs into sshd, so its pid is the Popen's)."""
        return [p for p in ns_pids(self.hosts[name].ns) if p != self.sshd[name].pid]

    def processes(self, name: str = "b", exe: str | None = None) -> list[psutil.Process]:
        """Live processes in the host's namespace (sshd's listener left out); ``exe``: only that binary's."""
        out = []
        for pid in self.pids(name):
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if exe is None or (cmd and Path(cmd[0]).name == exe):
                out.append(p)
        return out

    def listening(self, name: str = "b") -> list[tuple[str, int, str]]:
        """TCP listeners inside the host's namespace: (address, port, process name)."""
        out = subprocess.run(self.ns_argv(name, ["ss", "-H", "-ltnp"]), capture_output=True, text=True,
                             check=True).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            local = parts[3]
            addr, _, port = local.rpartition(":")
            m = re.search(r'\(\("([^"]+)"', line)
            rows.append((addr.strip("[]"), int(port), m.group(1) if m else ""))
        return rows

    def sent_to(self, name: str = "b") -> int:
        """Bytes this machine has sent to host ``name`` over its link (the veth's tx counter here)."""
        return int(Path(f"/sys/class/net/{self.hosts[name].veth}/statistics/tx_bytes").read_text())

    def received_from(self, name: str = "b") -> int:
        """Bytes this machine has received from host ``name`` over its link (the veth's rx counter here)."""
        return int(Path(f"/sys/class/net/{self.hosts[name].veth}/statistics/rx_bytes").read_text())

    def link(self, name: str, up: bool) -> None:
        """Cut the link to ``name`` (its end of the veth goes down: packets vanish silently, as in a partition;
        this side keeps its route, marked linkdown) or bring it back."""
        h = self.hosts[name]
        ip("-n", h.ns, "link", "set", h.peer, "up" if up else "down")

    def layout(self, path: Path, cards: list[tuple[str, int]], *, link: str = "ssh", name: str = "test rig",
               arcsplit: dict[str, Path] | None = None, forwards: str = "shared",
               rpc_servers: str = "per-card") -> Path:
        """A layout (issue 15's TOML) with the hosts its cards name; ``cards``: (host name or "", memory MiB);
        ``forwards``, ``rpc_servers``: the hosts' (written when not the default)."""
        lines = [f'name = "{name}"', ""]
        for h in (h for h in self.hosts.values() if any(c == h.name for c, _ in cards)):
            lines += ["[[hosts]]", f'name = "{h.name}"', f'ssh = "{h.name}"', f'ssh_config = "{self.ssh_config}"',
                      f'arcsplit = "{(arcsplit or {}).get(h.name, h.arcsplit)}"', f'link = "{link}"']
            if link == "direct":
                lines.append(f'address = "{h.addr}"')
            if forwards != "shared":
                lines.append(f'forwards = "{forwards}"')
            if rpc_servers != "per-card":
                lines.append(f'rpc_servers = "{rpc_servers}"')
            lines.append("")
        index = {h: 0 for h in ["", *self.hosts]}
        for host, mib in cards:
            lines += ["[[cards]]", 'backend = "cpu"', f"index = {index[host]}", 'name = "CPU"',
                      f"memory_mib = {mib}"]
            if host:
                lines.append(f'host = "{host}"')
            lines.append("")
            index[host] += 1
        path.write_text("\n".join(lines))
        return path


def keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True,
                   stdin=subprocess.DEVNULL, capture_output=True)


def ssh_config_text(hosts: Iterable[RemoteHost], key: Path, known_hosts: Path) -> str:
    blocks = []
    for h in hosts:
        blocks.append("\n".join([
            f"Host {h.name}",
            f"  HostName {h.addr}",
            f"  Port {h.ssh_port}",
            "  User root",
            f"  IdentityFile {key}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {known_hosts}",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes",
            "  UpdateHostKeys no",
            "  BatchMode yes",
            "  ControlMaster no",
            "  LogLevel ERROR",
        ]))
    return "\n\n".join(blocks) + "\n"


def remote_wrapper(h: RemoteHost, llama_dir: Path | None, env: dict[str, str]) -> str:
    """The host's ``arcsplit``: this venv's entry point with the host's own state/runtime dirs (shared FS)."""
    exports = {**env, "ARCSPLIT_STATE_DIR": str(h.state_dir), "ARCSPLIT_RUNTIME_DIR": str(h.dir / "rt"),
               "ARCSPLIT_BACKEND": "cpu", "LLAMA_CACHE": str(h.dir / "llama-cache")}  # its rpc-servers' own -c cache
    if llama_dir:
        exports["ARCSPLIT_LLAMA_DIR"] = str(llama_dir)
    # This checkout's code there, not whatever tree the venv's editable install points at (PYTHONPATH does not
    # cross ssh: sshd starts the wrapper with a fresh environment).
    exports["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    if os.environ.get("ARCSPLIT_CACHE_DIR"):
        exports["ARCSPLIT_CACHE_DIR"] = os.environ["ARCSPLIT_CACHE_DIR"]
    entry = Path(sys.executable).parent / "arcsplit"
    lines = ["#!/bin/sh", "# arcsplit on a test host (tests/_netns.py)"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    lines.append(f'exec {shlex.quote(str(entry))} "$@"')
    return "\n".join(lines) + "\n"


def _cleanup_all() -> None:
    for h in list(_live):
        h.close()


