"""Cards and rigs: the memory a plan must fit into, live or described in a layout file.

A layout (a TOML file; those in the repository's ``layouts/`` ship in the wheel and go by name) describes a rig you
may not have::

    name = "2x Arc Pro B70 32 GB"
    [[cards]]
    backend = "sycl"
    name = "Intel(R) Arc(TM) Pro B70 Graphics"
    memory_mib = 32656        # total
    free_mib = 32000          # optional, defaults to memory_mib
    margin_mib = 1024         # optional, kept free by the planner

An optional ``[plan]`` table pins a plan (``n_ctx``, ``tensor_split``, ...); it is kept as a dict.

Cards may live on other machines (docs/multihost.md): a ``[[hosts]]`` table names each one and how it is reached,
and a card's ``host = "b"`` puts it there (default: the main host, the machine running ``arcsplit serve``)::

    [[hosts]]
    name = "b"
    ssh = "user@b"            # the ssh destination (a Host alias of ssh_config works too)
    link = "ssh"              # or "direct" with address = "10.0.0.2": rpc-servers bind that address instead
    rpc_servers = "per-host"  # optional: one rpc-server for all of b's cards (default "per-card"; not on sycl)

The planner's layer order is the rig's card order, so each host's cards are kept together: the main host's
first, then each host's in [[hosts]] order.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from . import backends
from .errors import BadInput
from .netaddr import parse_ip, ssh_port

MiB = 1024 * 1024


def default_margin(backend: str) -> int:
    """Bytes kept free per card: llama.cpp's own --fit-target for GPUs. A CPU card's budget is already the limit,
    so it keeps only 16 MiB: the compute model was measured up to ~1.5 MiB low on the demo model's cards
    (bench/results/fit_context.md), and a plan must never allocate past what it promised."""
    return 16 * MiB if backends.get(backend).on_cpu else 1024 * MiB


@dataclass(frozen=True)
class Card:
    """One device that holds layers: a GPU, or a CPU budget served by an rpc-server."""

    backend: str
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    margin_bytes: int = -1
    pci: str | None = None
    driver: str | None = None
    host: str = ""  # the layout host that has this card; "" is the main host

    def __post_init__(self) -> None:
        backends.get(self.backend)  # an unknown name is a one-line error
        if self.total_bytes <= 0 or self.free_bytes <= 0:
            raise BadInput(f"card {self.index} ({self.name}) has no memory", "give it a positive memory_mib/free_mib")
        if self.free_bytes > self.total_bytes:
            object.__setattr__(self, "free_bytes", self.total_bytes)
        if self.margin_bytes < 0:
            object.__setattr__(self, "margin_bytes", default_margin(self.backend))

    @property
    def device(self) -> str:
        """The name llama.cpp gives this card in a process that sees all cards (SYCL0, CUDA1, ...)."""
        return backends.get(self.backend).device_name(self.index)

    @property
    def budget_bytes(self) -> int:
        """What the planner may fill: free memory less the margin."""
        return max(0, self.free_bytes - self.margin_bytes)


LINKS = ("ssh", "direct")
AGENTS = ("stdio", "standing")
FORWARDS = ("shared", "own")
RPC_SERVERS = ("per-card", "per-host")
# Why SYCL stays one rpc-server per card: one process's Level Zero context then spans several GPUs.
PER_HOST_SYCL = ("Intel's compute runtime 25.44-26.26 on kernels before 7.1 fails every allocation once one Level "
                 "Zero context spans two GPUs; one rpc-server per card is the workaround")
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")


@dataclass(frozen=True)
class Host:
    """Another machine that holds cards: reached over OpenSSH, where ``arcsplit node --stdio`` runs its
    rpc-servers. ``link``: how llama-server reaches them - "ssh" through an ``ssh -L`` forward (they bind
    127.0.0.1 there), "direct" straight to ``address`` (a LAN/VPN address of that host; faster, and anyone who
    can reach that address can drive the rpc-servers, since the RPC protocol has no authentication). ``agent``: how
    the node agent runs there - "stdio" started by each run over ssh, "standing" kept running by that host
    (``arcsplit node --listen``, a systemd unit) and reached with ``arcsplit node --attach``. ``forwards`` (link "ssh"):
    "shared" - each link is a forward on the agent's own ssh connection (no login of its own), "own" - each link its
    own ssh process and connection (its own core for the link's crypto). ``rpc_servers``: "per-card" - each card
    its own rpc-server; "per-host" - one rpc-server holds all of this host's cards (one port, one link; not on
    SYCL, see PER_HOST_SYCL)."""

    name: str
    ssh: str
    link: str = "ssh"
    address: str | None = None
    ssh_config: str | None = None  # ssh -F FILE
    arcsplit: str = "arcsplit"  # the command that runs arcsplit there
    bandwidth_gbit: float | None = None  # the link's bandwidth for the plan's cost estimate; None: the link's default
    agent: str = "stdio"
    model_dir: str | None = None  # where this host keeps the same GGUF files; None: the same path as here
    forwards: str = "shared"
    rpc_servers: str = "per-card"

    @property
    def per_host(self) -> bool:
        """One rpc-server holds all of this host's cards."""
        return self.rpc_servers == "per-host"

    def seed_path(self, local: str) -> str:
        """The path on this host of a GGUF that is at ``local`` here: its rpc-servers read the weights from it
        (patch 0006) when it is there; a different file there only misses (the weights are matched by hash)."""
        return str(PurePosixPath(self.model_dir) / PurePosixPath(local).name) if self.model_dir else local

    def __post_init__(self) -> None:
        where = f"host {self.name!r}"
        if not isinstance(self.name, str) or not _HOST_NAME.fullmatch(self.name) or self.name == "local":
            raise BadInput(f"host name {self.name!r} is not usable",
                           "name it with letters, digits, '.', '_' or '-' (up to 32, not 'local')")
        if (not isinstance(self.ssh, str) or not self.ssh or self.ssh.startswith("-")
                or any(c.isspace() for c in self.ssh)):
            raise BadInput(f"{where}: ssh = {self.ssh!r} is not an ssh destination",
                           'write ssh = "user@machine" (or a Host alias of your ssh_config)')
        ssh_port(self.ssh, where)
        if self.link not in LINKS:
            raise BadInput(f"{where}: link = {self.link!r} is unknown", f"use one of {', '.join(LINKS)}")
        if self.agent not in AGENTS:
            raise BadInput(f"{where}: agent = {self.agent!r} is unknown",
                           'use agent = "stdio" (started per run) or "standing" (kept running by that host)')
        if self.forwards not in FORWARDS:
            raise BadInput(f"{where}: forwards = {self.forwards!r} is unknown",
                           'use forwards = "shared" (the links ride the agent\'s ssh connection) or "own"')
        if self.rpc_servers not in RPC_SERVERS:
            raise BadInput(f"{where}: rpc_servers = {self.rpc_servers!r} is unknown",
                           'use rpc_servers = "per-card" (one rpc-server per card) or "per-host" (one for all of them)')
        if self.link == "direct":
            if not self.address:
                raise BadInput(f"{where}: link = \"direct\" needs an address",
                               "add address = \"<that host's LAN or VPN address>\", or use link = \"ssh\"")
            try:
                ip = parse_ip(self.address)  # ::ffff:0.0.0.0 is 0.0.0.0
            except ValueError:
                raise BadInput(f"{where}: address {self.address!r} is not an IP address",
                               "give the host's address on the link as an IP, e.g. 10.0.0.2") from None
            if ip.is_unspecified or ip.is_loopback:
                raise BadInput(f"{where}: address {self.address} would expose the rpc-servers on every interface"
                               if ip.is_unspecified else f"{where}: address {self.address} is a loopback address, "
                               "which llama-server would dial on its own machine",
                               "give the one address of that host that this machine reaches it by")
        elif self.address is not None:
            raise BadInput(f"{where}: address is only used with link = \"direct\"",
                           "remove address, or set link = \"direct\"")
        if not isinstance(self.arcsplit, str) or not self.arcsplit.strip():
            raise BadInput(f"{where}: arcsplit = {self.arcsplit!r} is empty", 'write arcsplit = "arcsplit" or its path')
        if self.bandwidth_gbit is not None and (isinstance(self.bandwidth_gbit, bool) or
                                                not isinstance(self.bandwidth_gbit, (int, float)) or
                                                self.bandwidth_gbit <= 0):
            raise BadInput(f"{where}: bandwidth_gbit = {self.bandwidth_gbit!r} must be a positive number",
                           "give the link's bandwidth in Gbit/s, e.g. 10")
        if self.model_dir is not None and (not isinstance(self.model_dir, str)
                                           or not PurePosixPath(self.model_dir).is_absolute()):
            raise BadInput(f"{where}: model_dir = {self.model_dir!r} is not an absolute path",
                           'write model_dir = "/path/to/models" as that host sees it')


@dataclass(frozen=True)
class Rig:
    """The cards a model is split across: each host's cards together, the main host's first (layer order)."""

    cards: tuple[Card, ...]
    name: str | None = None
    pinned_plan: dict[str, Any] = field(default_factory=dict, compare=False)
    hosts: tuple[Host, ...] = ()

    def __post_init__(self) -> None:
        if not self.cards:
            raise BadInput("the rig has no cards", "list at least one card")
        names = [h.name for h in self.hosts]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise BadInput(f"host {twice[0]!r} is named twice", "give each [[hosts]] entry its own name")
        for card in self.cards:
            if card.host and card.host not in names:
                raise BadInput(f"card {card.index} ({card.name}) names host {card.host!r}, which is not in [[hosts]]",
                               f"add a [[hosts]] entry named {card.host!r}, or use one of: "
                               f"{', '.join(names) or 'none (leave host out for this machine)'}")
            if card.host and not backends.get(card.backend).per_host_rpc and self.host(card.host).per_host:
                raise BadInput(f"host {card.host!r}: rpc_servers = \"per-host\" is refused on {card.backend} "
                               f"({PER_HOST_SYCL})",
                               f'remove rpc_servers from host {card.host!r} (per-card is the default)')
        order = {"": 0, **{n: i + 1 for i, n in enumerate(names)}}
        object.__setattr__(self, "cards", tuple(sorted(self.cards, key=lambda c: order[c.host])))  # stable

    def host(self, name: str) -> Host:
        """The [[hosts]] entry called ``name``."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise BadInput(f"no host {name!r} in the layout",
                       f"use one of: {', '.join(h.name for h in self.hosts) or 'none'}")


def per_host(hosts: Sequence[Host]) -> tuple[str, ...]:
    """The hosts whose cards share one rpc-server (Route.build's ``per_host``)."""
    return tuple(h.name for h in hosts if h.per_host)


def _layouts_dir() -> Path:
    """Where the shipped layouts are: the checkout's top-level ``layouts/`` (the one place a person edits them),
    which the wheel carries as ``arcsplit/data/layouts`` (pyproject.toml maps the folder into the package)."""
    package = Path(__file__).resolve().parent
    installed = package / "data" / "layouts"
    return installed if installed.is_dir() else package.parent / "layouts"


def shipped_layouts() -> dict[str, Path]:
    """The layouts arcsplit ships, by name (the file's stem): ``--layout 2x-arc-pro-b70``."""
    return {p.stem: p for p in sorted(_layouts_dir().glob("*.toml"))}


def layout_path(name_or_path: str | Path) -> Path:
    """A shipped layout's name, else a path (a name that is also a file here: the file, as before)."""
    p = Path(name_or_path)
    text = str(name_or_path)
    if p.exists() or "/" in text or text.endswith(".toml"):
        return p
    shipped = shipped_layouts()
    if text in shipped:
        return shipped[text]
    raise BadInput(f"layout {text!r} is neither a file nor a shipped layout",
                   f"`arcsplit layouts` lists the shipped ones ({', '.join(shipped)}), or give a .toml path")


def load_layout(path: str | Path) -> Rig:
    """Read a layout TOML file (or a shipped one, by name); every mistake becomes a one-line BadInput."""
    p = layout_path(path)
    if p.is_dir():
        raise BadInput(f"layout {p} is a directory", "pass a .toml file")
    if p.exists() and not p.is_file():  # a FIFO or device: reading it would wait forever
        raise BadInput(f"layout {p} is not a regular file (a pipe or device?)", "pass a .toml file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"layout {p} does not exist",
                       "check the path, or name a shipped layout (`arcsplit layouts` lists them)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read layout {p}: {exc}", "check the file's permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"layout {p} is not valid TOML ({exc})", "fix the syntax at that line") from None
    raw_cards = data.get("cards")
    if not isinstance(raw_cards, list) or not raw_cards:
        raise BadInput(f"layout {p} has no [[cards]]", "add one [[cards]] table per card")
    raw_hosts = data.get("hosts", [])
    if not isinstance(raw_hosts, list) or not all(isinstance(h, dict) for h in raw_hosts):
        raise BadInput(f"layout {p}: hosts is not a list of tables", "write each host as [[hosts]]")
    try:
        hosts = tuple(_host_from_toml(p, i, raw) for i, raw in enumerate(raw_hosts))
        cards = []
        nth: dict[str, int] = {}
        for i, raw in enumerate(raw_cards):
            if not isinstance(raw, dict):
                raise BadInput(f"cards[{i}] is not a table", "write each card as [[cards]]")
            host = raw.get("host", "")
            if not isinstance(host, str):
                raise BadInput(f"cards[{i}].host is not a host name", 'write host = "<a [[hosts]] name>"')
            cards.append(_card_from_toml(p, i, raw, nth.get(host, 0), host))
            nth[host] = nth.get(host, 0) + 1
        pinned = data.get("plan", {})
        if not isinstance(pinned, dict):
            raise BadInput("[plan] is not a table", "write it as a [plan] table")
        name = data.get("name")
        rig = Rig(cards=tuple(cards), name=str(name) if name is not None else p.stem, pinned_plan=pinned,
                  hosts=hosts)
        unused = [h.name for h in hosts if h.name not in nth]
        if unused:  # a forgotten host = "..." on a card: refused here, before anything logs in to that host
            raise BadInput(f"host {unused[0]!r} in [[hosts]] has no card",
                           f'add host = "{unused[0]}" to its [[cards]], or remove that [[hosts]] entry')
        return rig
    except BadInput as exc:
        if exc.problem.startswith(f"layout {p}"):
            raise
        raise BadInput(f"layout {p}: {exc.problem}", exc.fix) from None


_HOST_KEYS: dict[str, type | tuple[type, ...]] = {"name": str, "ssh": str, "link": str, "address": str,
              "ssh_config": str, "arcsplit": str,
              "bandwidth_gbit": (int, float), "agent": str, "model_dir": str, "forwards": str,
              "rpc_servers": str}


def _host_from_toml(p: Path, i: int, raw: dict[str, Any]) -> Host:
    """One [[hosts]] table; an unknown key is refused (a misspelt ``adress`` must not silently mean none)."""
    for key, value in raw.items():
        if key not in _HOST_KEYS:
            raise BadInput(f"hosts[{i}] has an unknown key {key!r}", f"use only {', '.join(_HOST_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, _HOST_KEYS[key]):
            raise BadInput(f"hosts[{i}].{key} has the wrong type", f"see docs/multihost.md for {key}")
    for key in ("name", "ssh"):
        if key not in raw:
            raise BadInput(f"hosts[{i}] has no {key}", 'give each host name = "..." and ssh = "user@machine"')
    config = raw.get("ssh_config")
    if config is not None:
        path = Path(config).expanduser()
        config = str(path if path.is_absolute() else (p.parent / path).absolute())  # relative to the layout
    return Host(name=raw["name"], ssh=raw["ssh"], link=raw.get("link", "ssh"), address=raw.get("address"),
                ssh_config=config, arcsplit=raw.get("arcsplit", "arcsplit"), bandwidth_gbit=raw.get("bandwidth_gbit"),
                agent=raw.get("agent", "stdio"), model_dir=raw.get("model_dir"), forwards=raw.get("forwards", "shared"),
                rpc_servers=raw.get("rpc_servers", "per-card"))


def _mib(p: Path, i: int, raw: dict[str, Any], key: str, default: float | None) -> int:
    value = raw.get(key, default)
    if value is None:
        raise BadInput(f"layout {p}: cards[{i}] has no {key}", f"add {key} = <MiB>")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"layout {p}: cards[{i}].{key} is not a number", f"write {key} = <MiB>")
    if value < 0 or (value == 0 and key != "margin_mib"):
        raise BadInput(f"layout {p}: cards[{i}].{key} = {value} must be positive", "give the card's memory in MiB")
    return int(value * MiB)


def _card_from_toml(p: Path, i: int, raw: dict[str, Any], nth: int, host: str) -> Card:
    """Card ``i`` of the file, the ``nth`` of its host: its default index there."""
    backend = str(raw.get("backend", "")).lower()
    if backend not in backends.REGISTRY:
        raise BadInput(f"layout {p}: cards[{i}].backend {raw.get('backend')!r} is unknown",
                       f"use one of {', '.join(backends.names())}")
    total = _mib(p, i, raw, "memory_mib", None)
    free = _mib(p, i, raw, "free_mib", total / MiB)
    margin = _mib(p, i, raw, "margin_mib", default_margin(backend) / MiB)
    index = raw.get("index", nth)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise BadInput(f"layout {p}: cards[{i}].index must be a non-negative integer", "write index = 0, 1, ...")
    return Card(
        backend=backend,
        index=index,
        name=str(raw.get("name", f"{backend} card {nth}")),
        total_bytes=total,
        free_bytes=free,
        margin_bytes=margin,
        pci=raw.get("pci"),
        driver=raw.get("driver"),
        host=host,
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def dump_layout(rig: Rig, plan: dict[str, Any] | None = None) -> str:
    """Render a rig (and optionally a pinned plan) as layout TOML that load_layout reads back."""
    lines = [f"name = {_toml_value(rig.name or 'my rig')}", ""]
    for h in rig.hosts:
        lines.append("[[hosts]]")
        for key in _HOST_KEYS:
            value = getattr(h, key)
            if value is not None and (key, value) not in (("link", "ssh"), ("arcsplit", "arcsplit"),
                                                          ("agent", "stdio"), ("forwards", "shared"),
                                                          ("rpc_servers", "per-card")):  # defaults
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    for card in rig.cards:
        lines.append("[[cards]]")
        if card.host:
            lines.append(f"host = {_toml_value(card.host)}")
        lines.append(f"backend = {_toml_value(card.backend)}")
        lines.append(f"index = {card.index}")
        lines.append(f"name = {_toml_value(card.name)}")
        lines.append(f"memory_mib = {card.total_bytes // MiB}")
        lines.append(f"free_mib = {card.free_bytes // MiB}")
        lines.append(f"margin_mib = {card.margin_bytes // MiB}")
        if card.pci:
            lines.append(f"pci = {_toml_value(card.pci)}")
        if card.driver:
            lines.append(f"driver = {_toml_value(card.driver)}")
        lines.append("")
    if plan:
        lines.append("[plan]")
        for key, value in plan.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def save_layout(path: str | Path, rig: Rig, plan: dict[str, Any] | None = None) -> Path:
    """Write atomically, so an interrupted save never leaves half a file."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(dump_layout(rig, plan), encoding="utf-8")
        tmp.replace(p)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write layout {p}: {exc.strerror}", "pick a writable path") from None
    return p
