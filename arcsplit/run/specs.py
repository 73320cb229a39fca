"""Plan + mode -> the argv and environment of every process in a serving group. Pure: no I/O.

The group is zero or more rpc-servers (one per card that llama-server does not hold itself) plus one
llama-server. What each process may see is decided here, per backend, because llama.cpp picks up every
visible device by default (reference: llama-cpp-observed.md, "Model device order").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .. import backends
from ..errors import BadInput
from ..llama.childenv import Dropped, overlay
from ..llama.features import RPC_OPTIONAL, RPC_REQUIRED, Features, fit_args
from ..llama.patches import SPIN_ENV
from ..planner import HOST_DEVICE, CardPlan, Plan

MODES = ("single", "multi", "multi+workaround", "hybrid", "rpc")
LOOPBACK = "127.0.0.1"
# llama-server flags whose value is a secret, and the variable llama-server reads the same value from
# (common/arg.cpp: `--api-key` .set_env("LLAMA_API_KEY")). argv shows in `ps`, state.json, logs and events;
# the environment does not.
SECRET_FLAGS = {"--api-key": "LLAMA_API_KEY"}


def split_secrets(args: Sequence[str]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Extra llama-server args -> (the args without secret flags, their values as environment variables)."""
    out: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag in SECRET_FLAGS and eq:
            env[SECRET_FLAGS[flag]] = value
        elif args[i] in SECRET_FLAGS and i + 1 < len(args):
            env[SECRET_FLAGS[args[i]]] = args[i + 1]
            i += 1
        else:
            out.append(args[i])
        i += 1
    return tuple(out), tuple(sorted(env.items()))




@dataclass(frozen=True)
class ProcessSpec:
    """One process to run: what to exec, with which environment, and what it serves."""

    name: str  # "rpc0", "rpc1", ..., "server"
    role: str  # "rpc" | "server"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # set on top of the supervisor's environment
    host: str
    port: int
    cards: tuple[int, ...]  # positions in plan.cards this process holds
    device: str | None = None  # for an rpc-server: its name in llama-server (RPC0, ...)
    ignore_sigpipe: bool = False
    env_unset: tuple[str, ...] = ()  # removed from the supervisor's environment (llama/childenv.py)
    features_off: tuple[str, ...] = ()  # what this binary lacks, so arcsplit left out (llama/features.py)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class ServeConfig:
    """Everything a group needs except the rpc-server ports, which may change on each restart."""

    plan: Plan
    mode: str
    backend: str
    server_bin: str
    rpc_bin: str
    host: str = LOOPBACK
    port: int = 8080
    rpc_host: str = LOOPBACK
    rpc_ports: tuple[int, ...] | None = None  # the user's fixed ports, else free ones are picked
    threads: int | None = None  # rpc-server -t; None: cores // n_cards
    rpc_cache_dir: str | None = None  # rpc-server -c with LLAMA_CACHE here: a reload reads weights from disk
    cores: int = 1
    extra_args: tuple[str, ...] = ()
    mode_env: tuple[tuple[str, str], ...] = field(default=())  # from ModeDecision.env (workarounds)
    forced_mode: bool = False
    secret_env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # llama-server only; never recorded
    rpc_spin_us: int = 0  # > 0: every process of a hybrid/rpc group polls the RPC link this long before sleeping
    ui_dir: str | None = None  # llama-server --path: the web UI (or the page on how to get it) at /
    env_dropped: tuple[Dropped, ...] = ()  # inherited variables changed for every child (llama/childenv.py)
    server_features: Features | None = None  # what a llama-server arcsplit did not build accepts; None: all
    rpc_features: Features | None = None  # the same for its rpc-server

    def __post_init__(self) -> None:
        public, secrets = split_secrets(self.extra_args)
        if secrets:  # a key given after `--` moves out of argv into llama-server's environment
            object.__setattr__(self, "extra_args", public)
            object.__setattr__(self, "secret_env", tuple(sorted({**dict(self.secret_env), **dict(secrets)}.items())))
        if self.mode not in MODES:
            raise BadInput(f"unknown mode {self.mode!r}", f"use one of {', '.join(MODES)}")
        n = n_rpc_servers(self)
        if self.rpc_ports is not None and len(self.rpc_ports) != n:
            raise BadInput(f"{len(self.rpc_ports)} rpc ports given for {n} rpc-servers",
                           f"give exactly {n} ports, or none")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def _rpc_cards(config: ServeConfig) -> list[int]:
    """Positions in plan.cards that get their own rpc-server, in llama.cpp device order."""
    cards = config.plan.cards
    offloaded = [i for i, c in enumerate(cards) if c.device != HOST_DEVICE]
    if config.mode == "rpc":
        return offloaded
    if config.mode == "hybrid":
        # On the CPU backend llama-server's own CPU (HOST_DEVICE) is the local card; on GPUs the first card is.
        if config.backend == "cpu":
            return offloaded
        return offloaded[1:]
    return []


def n_rpc_servers(config: ServeConfig) -> int:
    return len(_rpc_cards(config))


def rpc_threads(config: ServeConfig) -> int:
    if config.threads is not None:
        return max(1, config.threads)
    return max(1, config.cores // max(1, len(config.plan.cards)))


def _card_index(cp: CardPlan) -> int:
    return cp.card.index


def build_specs(config: ServeConfig, rpc_ports: Sequence[int]) -> tuple[ProcessSpec, ...]:
    """The rpc-servers (in --rpc order) then llama-server, for this mode, backend and these ports."""
    plan, backend, mode = config.plan, config.backend, config.mode
    rpc_positions = _rpc_cards(config)
    if len(rpc_ports) != len(rpc_positions):
        raise BadInput(f"{len(rpc_ports)} ports for {len(rpc_positions)} rpc-servers", "pass one port per rpc-server")
    if backend == "cpu" and mode in ("multi", "multi+workaround"):
        raise BadInput("the CPU backend has no multi-device mode", "use --mode rpc or --mode hybrid")
    if mode == "single" and len(plan.cards) != 1:
        raise BadInput(f"mode single needs one card, the plan has {len(plan.cards)}", "pick --mode auto")
    if mode in ("hybrid", "rpc") and not rpc_positions:
        raise BadInput(f"mode {mode} needs at least one card for an rpc-server", "use --mode single with one card")
    hygiene_set, unset = overlay(config.env_dropped)
    extra_env = {**dict(hygiene_set), **dict(config.mode_env)}
    if config.rpc_spin_us > 0 and rpc_positions:
        extra_env[SPIN_ENV] = str(config.rpc_spin_us)  # patch 0005: poll the link before sleeping
    threads = rpc_threads(config)

    specs: list[ProcessSpec] = []
    for k, (pos, port) in enumerate(zip(rpc_positions, rpc_ports)):
        cp = plan.cards[pos]
        env = dict(extra_env)
        env.update(backends.get(backend).visibility([_card_index(cp)]))
        argv = (config.rpc_bin, "-H", config.rpc_host, "-p", str(port), "-t", str(threads))
        if config.rpc_cache_dir:
            argv += ("-c",)
            env["LLAMA_CACHE"] = config.rpc_cache_dir  # the server keeps tensors > 10 MiB under <this>/rpc
        argv, off = fit_args(argv, config.rpc_features, config.rpc_bin, RPC_OPTIONAL, RPC_REQUIRED)
        specs.append(ProcessSpec(name=f"rpc{k}", role="rpc", argv=argv, env=tuple(sorted(env.items())),
                                 host=config.rpc_host, port=port, cards=(pos,), device=f"RPC{k}",
                                 ignore_sigpipe=True, env_unset=unset, features_off=off))

    # What llama-server itself holds, and the names of its devices in --device order.
    local_positions = [i for i in range(len(plan.cards)) if i not in rpc_positions]
    local_gpu = [i for i in local_positions if plan.cards[i].device != HOST_DEVICE] if backend != "cpu" else []
    order = sorted(local_gpu, key=lambda i: _card_index(plan.cards[i]))
    local_names = {i: backends.get(backend).device_name(order.index(i)) for i in local_gpu}
    rpc_names = {pos: f"RPC{k}" for k, pos in enumerate(rpc_positions)}
    names = [local_names.get(i) or rpc_names.get(i) for i, c in enumerate(plan.cards) if c.device != HOST_DEVICE]
    names = [n for n in names if n]  # CPU-backend cards held by llama-server itself have no device name

    env = dict(extra_env)
    env.update(backends.get(backend).visibility([_card_index(plan.cards[i]) for i in local_gpu]))
    env.update(config.secret_env)
    argv: list[str] = [config.server_bin, "-m", plan.model_path, "--host", config.host, "--port", str(config.port),
                       "--metrics"]
    if rpc_positions:
        argv += ["--rpc", ",".join(f"{config.rpc_host}:{p}" for p in rpc_ports)]  # before --device
    argv += plan.llama_server_args(devices=names)
    if backend == "cpu" and rpc_positions:
        argv += ["-t", str(threads)]  # llama-server computes the host card's layers; share cores evenly
    if config.ui_dir:
        argv += ["--path", config.ui_dir]  # before the user's args: their own --path or --no-ui wins
    fitted, off = fit_args(argv, config.server_features, config.server_bin)
    specs.append(ProcessSpec(name="server", role="server", argv=fitted + tuple(config.extra_args),
                             env=tuple(sorted(env.items())), host=config.host, port=config.port,
                             cards=tuple(local_positions), env_unset=unset, features_off=off))
    return tuple(specs)


def card_of_endpoint(specs: Sequence[ProcessSpec]) -> Mapping[str, int]:
    """rpc endpoint -> plan card position, to attribute `RPC0[host:port]` buffer lines to cards."""
    return {s.endpoint: s.cards[0] for s in specs if s.role == "rpc"}


def plan_devices(mode: str, backend: str, indices: Sequence[int]) -> list[str]:
    """The device name of each card (by its backend index, in --gpus order) as llama-server will see it."""
    n_cards = len(indices)
    if mode == "rpc":
        return [f"RPC{i}" for i in range(n_cards)]
    if mode == "hybrid":
        first = HOST_DEVICE if backend == "cpu" else backends.get(backend).device_name(0)
        return [first] + [f"RPC{i}" for i in range(n_cards - 1)]
    if backend == "cpu":
        # single: llama-server runs every layer on its CPU with --device none (build_specs names no device);
        # the planner sizes it as an ordinary card.
        return [f"CPU{i}" for i in indices]
    order = sorted(indices)
    return [backends.get(backend).device_name(order.index(i)) for i in indices]
