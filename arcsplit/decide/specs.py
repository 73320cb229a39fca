"""Plan + mode -> the argv and environment of every process in a serving group. Pure: no I/O.

Which process holds which card and what it may see is the Route's (arcsplit/route.py); this module adds the
binaries, ports, threads, the plan's placement flags and the user's extra args, and returns the argv exactly
as it is started.

A card on another host (docs/multihost.md) is an rpc-server started there by the node agent (``node`` names the
host). Over a link = "ssh" it binds 127.0.0.1 there and llama-server dials the local end of an ``ssh -L`` forward,
itself a member of the group (role "link"); over a link = "direct" it binds the host's named address and
llama-server dials that. Secrets only ever reach llama-server, which runs here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from .. import backends
from ..errors import BadInput
from ..hosts import forward_argv
from ..llama.childenv import SERVER_KEY_VAR, Dropped, overlay
from ..llama.features import RPC_OPTIONAL, RPC_REQUIRED, Features, fit_args
from ..llama.patches import GATE_ENV, GATE_HOST_ENV, GATE_HOST_NEVER_KIB, INPUT_ON_CARD_ENV, SHM_ENV, SPIN_ENV
from ..llama.seeding import SEED_FLAG
from ..modes import Mode
from ..netaddr import SERVER_PORT, local_url
from ..proc.spec import LOOPBACK, ProcessSpec
from ..rig import Host, per_host
from ..roles import Role
from ..route import HOST_DEVICE, Route
from .weightcache import INDEX_ENV, store

if TYPE_CHECKING:  # the node agent builds ProcessSpecs too: it should not import the planner
    from ..planner import Plan

# llama-server flags whose value is a secret, and the variable llama-server reads the same value from
# (common/arg.cpp: `--api-key` .set_env("LLAMA_API_KEY")). argv shows in `ps`, state.json, logs and events;
# the environment does not.
SECRET_FLAGS = {"--api-key": SERVER_KEY_VAR}
ALIAS_FLAGS = ("-a", "--alias")  # llama-server's spellings of the served model's name: the user's own one wins
SERVER_LOG_ARGS = ("-lv", "4")  # buffer-size lines are printed at verbosity 4 (llama.cpp src/llama-model.cpp)
# llama-server only reports its load progress in the router's child protocol (tools/server/server-models.cpp,
# `cmd_child_to_router:state:{json}` on stdout); setting this variable opts in. It also makes llama-server exit
# on stdin EOF, a second guard besides the parent-death signal.
ROUTER_PORT_ENV = "LLAMA_SERVER_ROUTER_PORT"
# A SIGTERMed llama-server with a request in flight never exits: it joins its HTTP threads, and the request's thread
# waits for a result from the task loop the signal stopped. A second SIGTERM is its own forced exit ("Received second
# interrupt, terminating immediately", tools/server/server.cpp). A stop sends one this long after the first, instead
# of waiting out the grace for the SIGKILL; an idle llama-server has exited by then.
SERVER_TERM_AGAIN = 2.0


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
class ServeConfig:
    """Everything a group needs except the rpc-server ports, which may change on each restart."""

    plan: Plan
    mode: Mode
    backend: str
    server_bin: str
    rpc_bin: str
    host: str = LOOPBACK
    port: int = SERVER_PORT
    rpc_host: str = LOOPBACK
    rpc_ports: tuple[int, ...] | None = None  # the user's fixed ports, else free ones are picked
    threads: int | None = None  # rpc-server -t; None: cores // n_cards
    rpc_cache_dir: str | None = None  # rpc-server -c with LLAMA_CACHE here: a reload reads weights from disk
    rpc_seed: tuple[str, ...] = ()  # with rpc_cache_dir: the GGUF files rpc-servers serve weights from (weightcache)
    cores: int = 1
    extra_args: tuple[str, ...] = ()
    alias: str | None = None  # llama-server --alias: the model's name in /v1/models (model.served_name)
    mode_env: tuple[tuple[str, str], ...] = field(default=())  # from ModeDecision.env (workarounds)
    forced_mode: bool = False
    secret_env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # llama-server only; never recorded
    rpc_spin_us: int = 0  # > 0: every process of a hybrid/rpc group polls the RPC link this long before sleeping
    rpc_shm: bool = False  # llama-server and the rpc-servers of this host link through shared memory (patch 0008)
    rpc_gate: bool = False  # gated sets on (Route.gated_sets): llama-server announces an rpc-server's input first
    rpc_gate_host_kib: int | None = None  # the user's ARCSPLIT_RPC_GATE_HOST_KIB; None: no host input gated
    ui_dir: str | None = None  # llama-server --path: the web UI (or the page on how to get it) at /
    env_dropped: tuple[Dropped, ...] = ()  # inherited variables changed for every child (llama/childenv.py)
    server_features: Features | None = None  # what a llama-server arcsplit did not build accepts; None: all
    rpc_features: Features | None = None  # the same for its rpc-server
    hosts: tuple[Host, ...] = ()  # the layout's other machines (the plan's cards name them)
    node_bins: tuple[tuple[str, str], ...] = ()  # host -> its rpc-server binary (from its node's hello)

    def __post_init__(self) -> None:
        public, secrets = split_secrets(self.extra_args)
        if secrets:  # a key given after `--` moves out of argv into llama-server's environment
            object.__setattr__(self, "extra_args", public)
            object.__setattr__(self, "secret_env", tuple(sorted({**dict(self.secret_env), **dict(secrets)}.items())))
        n = n_rpc_servers(self)  # builds the route: an impossible mode is a one-line error here
        if self.rpc_ports is not None and len(self.rpc_ports) != n:
            raise BadInput(f"{len(self.rpc_ports)} rpc ports given for {n} rpc-servers",
                           f"give exactly {n} ports, or none")

    @property
    def route(self) -> Route:
        """Who holds which card: from the mode, the backend and the plan's cards (in --gpus order)."""
        return Route.build(self.mode, self.backend, [c.card.index for c in self.plan.cards],
                           [c.card.host for c in self.plan.cards], per_host(self.hosts))

    def host_named(self, name: str) -> Host:
        """The layout host a card names; a plan naming one the config lacks is a one-line error."""
        for h in self.hosts:
            if h.name == name:
                return h
        raise BadInput(f"the plan puts cards on host {name!r}, which the configuration does not describe",
                       "serve with the layout that names it (--layout)")

    @property
    def url(self) -> str:
        return local_url(self.host, self.port)


def n_rpc_servers(config: ServeConfig) -> int:
    return len(config.route.rpc)


def n_links(config: ServeConfig) -> int:
    """ssh forwards the group runs: one per rpc-server on a host reached over link = "ssh"."""
    return sum(1 for p in config.route.rpc if p.host and config.host_named(p.host).link == "ssh")


def rpc_threads(config: ServeConfig) -> int:
    if config.threads is not None:
        return max(1, config.threads)
    return max(1, config.cores // max(1, len(config.plan.cards)))


def build_specs(config: ServeConfig, rpc_ports: Sequence[int], link_ports: Sequence[int] = ()
                ) -> tuple[ProcessSpec, ...]:
    """The rpc-servers (in --rpc order), their ssh links, then llama-server: complete argv and environment, nothing
    added later. ``rpc_ports``: one per rpc-server, on the host that runs it; ``link_ports``: one per ssh link,
    the local end of its forward here."""
    plan, route = config.plan, config.route
    if len(rpc_ports) != len(route.rpc):
        raise BadInput(f"{len(rpc_ports)} ports for {len(route.rpc)} rpc-servers", "pass one port per rpc-server")
    if len(link_ports) != n_links(config):
        raise BadInput(f"{len(link_ports)} link ports for {n_links(config)} ssh links", "pass one port per link")
    if [c.device for c in plan.cards] != route.devices:
        raise BadInput(f"the plan names its cards {[c.device for c in plan.cards]}, mode {route.mode} runs them as "
                       f"{route.devices}", "plan with the same mode (arcsplit plan --mode)")
    hygiene_set, unset = overlay(config.env_dropped)
    extra_env = {**dict(hygiene_set), **dict(config.mode_env)}
    if config.rpc_spin_us > 0 and route.rpc:
        extra_env[SPIN_ENV] = str(config.rpc_spin_us)  # patch 0005: poll the link before sleeping
    if config.rpc_gate and route.rpc:  # llama-server reads both; an rpc-server offers gates whatever it inherits
        extra_env[GATE_ENV] = "1"
        extra_env[GATE_HOST_ENV] = str(GATE_HOST_NEVER_KIB if config.rpc_gate_host_kib is None
                                       else config.rpc_gate_host_kib)
    threads = rpc_threads(config)
    shm = "1" if config.rpc_shm else "0"  # patch 0008, for this host's processes (another host's always decline)

    specs: list[ProcessSpec] = []
    links: list[ProcessSpec] = []
    free_links = list(link_ports)
    node_bins = dict(config.node_bins)
    for proc, port in zip(route.rpc, rpc_ports):
        remote = config.host_named(proc.host) if proc.host else None
        # only an rpc-server of this host may map llama-server's rings (never one on another host, even where a
        # test's "hosts" share this machine's /dev/shm)
        env = {**extra_env, SHM_ENV: shm if remote is None else "0", **dict(proc.env)}
        if remote is None:
            binary, bind = config.rpc_bin, config.rpc_host
        else:  # the node resolves a bare name to its managed build
            binary = node_bins.get(remote.name, "ggml-rpc-server")
            bind = remote.address if remote.link == "direct" and remote.address else LOOPBACK
        rpc_argv = [binary, "-H", bind, "-p", str(port), "-t", str(threads)]
        if proc.select:  # one rpc-server for several cards: each by its name there, in layer order
            rpc_argv += ["-d", ",".join(proc.select)]
        if config.rpc_cache_dir and remote is None:
            rpc_argv.append("-c")
            env["LLAMA_CACHE"] = config.rpc_cache_dir  # the server keeps tensors > 10 MiB under <this>/rpc
            for gguf in config.rpc_seed:  # this machine holds the GGUF: serve the weights from it (patch 0006)
                rpc_argv += [SEED_FLAG, gguf]
        elif remote is not None:
            # Always cached there: a restart reloads weights from that host's disk, not over the link. The cache
            # is the node's (rpc-server's default under that user's cache dir), so no path of this machine.
            rpc_argv.append("-c")
            for gguf in config.rpc_seed:  # the same GGUF there (model_dir): its weights never cross the link;
                rpc_argv += [SEED_FLAG, remote.seed_path(gguf)]  # the agent drops a file it does not have
        fitted_rpc, off = fit_args(rpc_argv, config.rpc_features, binary, RPC_OPTIONAL, RPC_REQUIRED)
        connect = ""
        if remote is not None and remote.link == "ssh":
            local = free_links.pop(0)
            connect = f"{LOOPBACK}:{local}"
            links.append(ProcessSpec(name=f"{proc.name}-link", role=Role.LINK,
                                     argv=tuple(forward_argv(remote, local, port, bind)), env=(), host=LOOPBACK,
                                     port=local, cards=(), ignore_sigpipe=True, env_unset=unset, node=remote.name))
        specs.append(ProcessSpec(name=proc.name, role=Role.RPC, argv=fitted_rpc, env=tuple(sorted(env.items())),
                                 host=bind, port=port, cards=proc.cards, devices=proc.devices,
                                 ignore_sigpipe=True, env_unset=unset, features_off=off, node=proc.host,
                                 connect=connect))
    rpc_specs = list(specs)
    specs += links
    specs.append(_server_spec(config, rpc_specs, extra_env, unset, shm, threads))
    return tuple(specs)


def _server_spec(config: ServeConfig, rpc_specs: list[ProcessSpec], extra_env: dict[str, str],
                 unset: tuple[str, ...], shm: str, threads: int) -> ProcessSpec:
    """llama-server's spec, dialling ``rpc_specs`` (in --rpc order)."""
    plan, route, server = config.plan, config.route, config.route.server
    # LLAMA_SERVER_ROUTER_PORT opts into the router's child protocol: load progress on stdout, exit on stdin EOF.
    env = {**extra_env, **dict(server.env), **dict(config.secret_env), ROUTER_PORT_ENV: str(config.port)}
    if plan.options.input_on_first:  # patch 0015: the token embeddings on the first card, where the plan holds them
        env[INPUT_ON_CARD_ENV] = "1"
    if route.rpc:  # offered to every rpc-server; those of other hosts decline
        env[SHM_ENV] = shm
    if config.rpc_seed and config.rpc_cache_dir and route.rpc:
        env[INDEX_ENV] = str(store(config.rpc_cache_dir))  # the weights' hashes come from the rpc-servers' index
    argv: list[str] = [config.server_bin, "-m", plan.model_path, "--host", config.host, "--port", str(config.port),
                       "--metrics"]
    if route.rpc:
        argv += ["--rpc", ",".join(s.dial for s in rpc_specs)]  # before --device
    argv += plan.llama_server_args(devices=route.server_devices, buffers=rpc_buffer_types(rpc_specs))
    if backends.get(config.backend).on_cpu and route.rpc:
        argv += ["-t", str(threads)]  # llama-server computes the host card's layers; share cores evenly
    if SERVER_LOG_ARGS[0] not in config.extra_args:  # the user's own verbosity wins
        argv += list(SERVER_LOG_ARGS)
    if config.alias and not set(ALIAS_FLAGS) & set(config.extra_args):
        argv += ["--alias", config.alias]  # else llama-server names the model by its path
    if config.ui_dir:
        argv += ["--path", config.ui_dir]  # before the user's args: their own --path or --no-ui wins
    fitted, off = fit_args(argv, config.server_features, config.server_bin)
    return ProcessSpec(name=server.name, role=Role.SERVER, argv=fitted + tuple(config.extra_args),
                       env=tuple(sorted(env.items())), host=config.host, port=config.port, cards=server.cards,
                       devices=server.devices, keep_stdin=True, env_unset=unset, features_off=off,
                       term_again=SERVER_TERM_AGAIN)


def _rpc_buffer_type(spec: ProcessSpec, j: int) -> str:
    """The buffer type of the ``j``-th card an rpc-server holds, which -ot takes and the buffer lines print
    (logs.BufferLine.key): its index on its server (its place in -d) and the endpoint (ggml-rpc.cpp)."""
    return f"RPC{j}[{spec.dial}]"


def rpc_buffer_types(specs: Sequence[ProcessSpec]) -> dict[str, str]:
    """llama-server's RPC device name of each card an rpc-server holds -> its buffer type name."""
    return {d: _rpc_buffer_type(s, j) for s in specs if s.role == Role.RPC for j, d in enumerate(s.devices)}


def card_of_buffer(specs: Sequence[ProcessSpec], host_position: int | None) -> Callable[[str], int | None]:
    """A buffer key of llama-server's log (an RPC buffer type, a device name, CPU...) -> the plan card it is on."""
    table: dict[str, int] = {}
    for s in specs:
        if s.role == Role.RPC:  # RPCj[host:port]: device names repeat across restarts, endpoints don't
            table.update((_rpc_buffer_type(s, j), pos) for j, pos in enumerate(s.cards))
        else:
            table.update((d, pos) for d, pos in zip(s.devices, s.cards) if d != HOST_DEVICE)

    def card(key: str) -> int | None:
        if key in table:
            return table[key]
        return host_position if key.startswith(HOST_DEVICE) else None

    return card
