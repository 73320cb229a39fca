"""Route: which process holds which card, under which llama.cpp device name, seeing which cards. Pure: no I/O.

One value answers it for the planner (device names, ubatch), the process specs (argv and environment), the
supervisor (buffer lines -> cards), telemetry and the dashboard (the holder of each card, from status), the probe
and ``arcsplit plan``. Nothing else derives it.

    route = Route.build("hybrid", "sycl", [0, 1, 2])
    route.devices            # ("SYCL0", "RPC0", "RPC1"): the plan's names, in --gpus order
    route.holder(1)          # "rpc0"
    route.processes          # rpc0, rpc1 (in --rpc order), then server

The group is zero or more rpc-servers (one per card that llama-server does not hold itself) plus one llama-server.
What each process may see is set here per backend, because llama.cpp opens every device it can see.

Cards on other machines (``hosts``: the layout host of each position, "" for this one) each get an rpc-server of
their own on that host, unless the host is ``per_host`` (layout ``rpc_servers = "per-host"``): then one rpc-server
there holds all of that host's cards (``ggml-rpc-server -d DEV1,DEV2``, in layer order), where one process can hold
several cards (CPU, CUDA, Vulkan; never SYCL, rig.PER_HOST_SYCL). The mode's rule applies to this machine's cards
only. rpc-servers are named rpc0.. in --rpc order: this machine's first, then the other hosts' in layer order.
llama-server numbers RPC devices across its --rpc endpoints in that order, each endpoint's in its -d order
(ggml-rpc.cpp ggml_backend_rpc_add_server), so RPCk is still the k-th card held by an rpc-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from . import backends
from .errors import BadInput
from .modes import MODES, Mode, parse
from .rig import PER_HOST_SYCL
from .roles import Role

__all__ = ["MODES", "Mode", "Route", "RouteCard", "RouteProcess", "holders"]

# llama-server's own CPU as a plan card: it keeps the first layers and is never named in --device.
HOST_DEVICE = "CPU"
SERVER = "server"
# Micro-batch per route when the user does not set one. Over RPC every ubatch pays a blocking round trip per
# device, yet larger ubatches made RPC prefill *worse* on 2x H200 (ub 2048: 0.24x of native; local-first hybrid
# with ub 256: 0.69x vs 0.50x at 512; see bench/RESULTS.md): a prompt of two ubatches lets the second card compute
# the first half while the first card computes the second. With the current patch set the overlap still shows on two
# CPU cards (prefill at 256 over 512: all-RPC 1.33x, hybrid 1.20x; bench/results/throughput_cpu_ubatch_overlap.md).
# One GPU shared by every process cannot show it. Native routes keep llama.cpp's 512.
RPC_UBATCH = 256
NATIVE_UBATCH = 512
# Polling budget of the RPC link's threads on GPU groups (patch 0005): covers a token's wait for the other card on
# the cards we serve. Only with cores to spare: up to three threads poll during generation (never on the CPU
# backend, where the cards are those cores). ARCSPLIT_RPC_SPIN_US in the environment overrides it (0: off).
RPC_SPIN_US = 20_000
RPC_SPIN_MIN_CORES = 8
OUTPUT_LAYER_CHOICES = ("auto", "local", "last")

Env = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RouteCard:
    """One card of the route, at its position in --gpus (and plan) order."""

    position: int
    index: int  # the backend's card index (--gpus value) on its host
    holder: str  # the process that holds it: "server" or "rpcK"
    device: str  # its name in the plan and in llama-server ("SYCL0", "RPC1"; HOST_DEVICE: llama-server's CPU)
    env: Env  # the visibility environment of its holder
    host: str = ""  # the layout host it is on; "" is this machine


@dataclass(frozen=True)
class RouteProcess:
    """One process of the group: what it holds and what it may see."""

    name: str  # "rpc0", "rpc1", ..., "server"
    role: Role  # Role.RPC or Role.SERVER
    cards: tuple[int, ...]  # positions it holds
    devices: tuple[str, ...]  # the llama-server device name of each of those cards
    env: Env  # visibility environment (what it may see of the backend's cards)
    host: str = ""  # the layout host it runs on; "" is this machine
    select: tuple[str, ...] = ()  # an rpc-server's -d list (its cards' names in that process); () one card, no -d


@dataclass(frozen=True)
class Route:
    """(mode, backend, cards) -> every card's holder, device name and visibility; the route's defaults."""

    mode: Mode
    backend: str
    cards: tuple[RouteCard, ...]
    processes: tuple[RouteProcess, ...]  # rpc-servers in --rpc order, then llama-server

    @classmethod
    def build(cls, mode: str, backend: str, indices: Sequence[int], hosts: Sequence[str] | None = None,
              per_host: Collection[str] = ()) -> "Route":
        """The route of ``mode`` over the cards ``indices`` (in --gpus order) of ``backend``; ``hosts``: the layout
        host of each card ("" this machine; None: all here). Each host's cards must be together, this machine's
        first, as Rig keeps them. ``per_host``: the other hosts whose cards share one rpc-server."""
        be = backends.get(backend)
        m = parse(mode)
        n = len(indices)
        where = _check_hosts(indices, hosts)
        here = [p for p in range(n) if not where[p]]
        _check_mode(m, be, n, len(here))
        # Positions llama-server holds itself (of this machine's cards); every other card gets its own rpc-server,
        # in --gpus order.
        local = here if m is Mode.SINGLE or m.one_context else here[:1] if m is Mode.HYBRID else []
        remote = [p for p in range(n) if p not in local]
        if be.on_cpu:
            # CPU cards: llama-server's own CPU is a card only in hybrid (it keeps the first layers); in single mode
            # it runs everything with `--device none` and the planner sizes the card as an ordinary one.
            local_names = {p: (HOST_DEVICE if m is Mode.HYBRID else be.device_name(indices[p])) for p in local}
        else:
            order = sorted(indices[p] for p in local)  # a process numbers the cards it sees in ascending order
            local_names = {p: be.device_name(order.index(indices[p])) for p in local}
        server_env = tuple(sorted(be.visibility([indices[p] for p in local] if not be.on_cpu else []).items()))
        if not be.per_host_rpc and any(where[p] in per_host for p in remote):
            raise BadInput(f"one rpc-server per host is refused on {backend} ({PER_HOST_SYCL})",
                           'leave rpc_servers out of that [[hosts]] entry (per-card is the default)')
        groups: list[list[int]] = []  # the positions of each rpc-server, in --rpc order
        for p in remote:
            if groups and where[p] and where[p] in per_host and where[groups[-1][0]] == where[p]:
                groups[-1].append(p)
            else:
                groups.append([p])
        rpcs = []
        first = 0  # llama-server's RPC device number of each rpc-server's first card
        for k, group in enumerate(groups):
            mine = [indices[p] for p in group]
            env = tuple(sorted(be.visibility(mine).items()))
            select: tuple[str, ...] = ()
            if where[group[0]] in per_host:  # names as that process sees them: ascending index, as visibility shows
                select = tuple(be.own_name(sorted(mine).index(i)) for i in mine)
            devices = tuple(f"RPC{first + j}" for j in range(len(group)))
            rpcs.append(RouteProcess(f"rpc{k}", Role.RPC, tuple(group), devices, env, where[group[0]], select))
            first += len(group)
        server = RouteProcess(SERVER, Role.SERVER, tuple(local), tuple(local_names[p] for p in local), server_env)
        processes = (*rpcs, server)
        cards: list[RouteCard] = []
        for p in range(n):
            proc = next(q for q in processes if p in q.cards)
            cards.append(RouteCard(p, indices[p], proc.name, proc.devices[proc.cards.index(p)], proc.env, where[p]))
        return cls(m, backend, tuple(cards), processes)

    # -- what the planner and llama-server's argv take from it ---------------------------------------------

    @property
    def devices(self) -> list[str]:
        """Each card's device name in --gpus order: the names the planner plans under."""
        return [c.device for c in self.cards]

    @property
    def server_devices(self) -> list[str]:
        """llama-server's --device list: every card but the ones its own CPU computes (those have no device)."""
        on_cpu = backends.get(self.backend).on_cpu
        return [c.device for c in self.cards if not (on_cpu and c.holder == SERVER)]

    @property
    def rpc(self) -> tuple[RouteProcess, ...]:
        return tuple(p for p in self.processes if p.role == Role.RPC)

    @property
    def server(self) -> RouteProcess:
        return self.processes[-1]

    def holder(self, position: int) -> str:
        return self.cards[position].holder

    @property
    def host_position(self) -> int | None:
        """The card computed by llama-server's own CPU (CPU-backend hybrid), if any."""
        return next((c.position for c in self.cards if c.device == HOST_DEVICE), None)

    # -- the route's defaults ---------------------------------------------------------------------------------

    @property
    def ubatch(self) -> int:
        """-ub when the user sets none: small over an RPC link, llama.cpp's default on a native context."""
        return RPC_UBATCH if self.rpc else NATIVE_UBATCH

    def link_polling_us(self, cores: int, override: str | None = None) -> int:
        """Patch 0005's budget for this group's RPC link; ``override`` is the user's ARCSPLIT_RPC_SPIN_US."""
        if override is not None:
            try:
                return max(0, int(override))
            except ValueError:
                raise BadInput(f"ARCSPLIT_RPC_SPIN_US={override!r} is not a number of microseconds",
                               "set ARCSPLIT_RPC_SPIN_US to a whole number (0 turns polling off)") from None
        return RPC_SPIN_US if not backends.get(self.backend).on_cpu and cores >= RPC_SPIN_MIN_CORES else 0

    def gated_sets(self, override: bool | None = None) -> bool:
        """Whether llama-server announces an activation bound for an rpc-server before its data (gated sets,
        ARCSPLIT_RPC_GATE; patches 0001, 0003, 0007 and 0009), so the rpc-server launches its graph first.
        ``override`` is the user's ARCSPLIT_RPC_GATE. On by default where it was measured faster: all-RPC on one
        machine whose cards wait on a host word (CUDA): on one H100 under MPS, decode 3-5 % faster in 3 of 3 paired
        runs on a MoE and a dense model, the MoE's prefill 3 % (bench/results/gpu/ttft/). Off in hybrid (no
        difference resolved), across hosts and on other backends (not measured)."""
        if override is not None:
            return override
        return (self.mode is Mode.RPC and backends.get(self.backend).host_word_wait
                and not any(c.host for c in self.cards))

    def input_on_card(self, choice: bool | None = None) -> bool:
        """Whether the token embeddings go on the first card (PlanOptions.input_on_first, patch 0015). In an all-RPC
        group that card is an rpc-server's, and llama.cpp's place for them (llama-server's CPU) sends every prompt
        token's embedding over its link (n_embd floats) where the card's own lookup needs the id (4 bytes): 8 MiB of
        a 512-token prompt of a 4096-wide model. auto (``choice`` None, the user's ARCSPLIT_INPUT_ON_CARD unset) does
        it on a GPU backend and wherever that first card is on another host: on one H100 under MPS (paired, 3 runs,
        bench/results/gpu/ttft/*_s22.md) the dense 7.2B model's first token came 0.94x as late in 3 of 3 runs and
        the MoE's in 2 of 3; across a shaped link the bytes to that host fell by the embeddings (0.78x the first
        token at 100 Mbit/s). CPU cards on one machine keep llama.cpp's place (compute-bound: nothing to gain, the
        table's bytes to pay). Hybrid and one-context groups hold their first card in llama-server's own process:
        never."""
        if self.mode is not Mode.RPC or choice is False:
            return False
        return True if choice else bool(self.cards[0].host) or not backends.get(self.backend).on_cpu

    def output_local(self, choice: str = "auto") -> bool | None:
        """Whether the output layer goes on the first card (PlanOptions.output_on_first). In a hybrid group that is
        llama-server's own card; there the logits (n_vocab floats a row) then never cross the RPC link. On one
        machine auto keeps llama.cpp's place (the last card): on 2x H200 with a 32k vocabulary, local measured the
        same within noise (bench/RESULTS.md), so it is an opt-in for models with big vocabularies (not measured
        here). When the last card is on another host and the first is here, the logits would cross the network
        every token: local and auto both move it here; auto answers None, "here unless the model ties its output
        to the token embeddings" (which -ot cannot move; the planner keeps it last and says so)."""
        if choice not in OUTPUT_LAYER_CHOICES:
            raise BadInput(f"unknown --output-layer {choice!r}", f"use one of {', '.join(OUTPUT_LAYER_CHOICES)}")
        if choice != "last" and self.cross_host_output:
            return None if choice == "auto" else True
        return choice == "local" and self.mode is Mode.HYBRID

    @property
    def cross_host_output(self) -> bool:
        """The last card (llama.cpp's place for the output layer) is on another host, the first on this one."""
        return not self.cards[0].host and bool(self.cards[-1].host)

    def to_dict(self) -> dict[str, Any]:
        """The ``route`` of status() and ``plan --json``."""
        return {"mode": self.mode, "backend": self.backend,
                "cards": [{"position": c.position, "index": c.index, "holder": c.holder, "device": c.device,
                           "env": dict(c.env), "host": c.host} for c in self.cards],
                "processes": [{"name": p.name, "role": p.role, "cards": list(p.cards), "devices": list(p.devices),
                               "env": dict(p.env), "host": p.host, "select": list(p.select)}
                              for p in self.processes]}


def _check_hosts(indices: Sequence[int], hosts: Sequence[str] | None) -> tuple[str, ...]:
    """Each card's host ("" here), once checked: one per card, no card twice, each host's cards together and this
    machine's first."""
    n = len(indices)
    if n < 1:
        raise BadInput("no cards to run on", "pass --gpus with at least one card")
    where = tuple(hosts) if hosts is not None else ("",) * n
    if len(where) != n:
        raise BadInput(f"{len(where)} hosts for {n} cards", "give one host per card")
    if len(set(zip(where, indices))) != n:
        raise BadInput(f"card list {list(indices)} names a card twice", "list each card once")
    runs = [h for k, h in enumerate(where) if k == 0 or where[k - 1] != h]
    if len(set(runs)) != len(runs) or ("" in runs and runs[0] != ""):
        raise BadInput("a host's cards are not next to each other in layer order",
                       "list this machine's cards first, then each host's cards together")
    return where


def _check_mode(mode: Mode, be: backends.Backend, n: int, n_here: int) -> None:
    """Whether ``mode`` can run ``n`` cards of ``be``, ``n_here`` of them on this machine."""
    if mode is Mode.SINGLE and n_here != n:
        raise BadInput("mode single runs one card on this machine, but cards on other hosts are in the layout",
                       "use --mode hybrid or rpc (or auto)")
    if mode.needs_local_server_card and not n_here:
        raise BadInput(f"mode {mode} needs a card on this machine for llama-server, but every card is on "
                       f"another host", "use --mode rpc (or auto)")
    if mode is Mode.SINGLE and n != 1:
        raise BadInput(f"mode single needs one card, there are {n}", "pick --mode auto")
    if be.on_cpu and mode.one_context:
        raise BadInput("the CPU backend has no multi-device mode", "use --mode rpc or --mode hybrid")
    if mode.needs_local_server_card and n < 2:
        raise BadInput(f"mode {mode} needs at least 2 cards", "pass --gpus with 2+ cards, or drop --mode")
    if mode is Mode.MULTI_WORKAROUND and not be.one_context_workaround:
        having = ", ".join(b.name for b in backends.REGISTRY.values() if b.one_context_workaround)
        raise BadInput(f"the multi+workaround mode exists only for {having}", "use --mode multi")


def holders(status: Mapping[str, Any]) -> list[str]:
    """The holder of each plan card, read from a status snapshot (``status["route"]``); [] before there is one."""
    return [str(c.get("holder")) for c in ((status.get("route") or {}).get("cards") or [])]
