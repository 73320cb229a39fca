"""arcsplit's own patches to llama.cpp, applied to the tree the managed build compiles.

They change what no flag reaches (how the RPC client waits, see each patch's header). The wire protocol changes
only where both ends offer it (gated sets, patches 0001 and 0003, offered in HELLO and asked for with GATE_ENV), so a
patched build still talks to stock rpc-servers and stock clients. The patch files live in
``arcsplit/data/patches`` (applied in name order with ``patch -p1``); their digest is part of the build
key, so editing a patch rebuilds, and ``arcsplit llama build --no-patches`` builds the stock tree.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, BuildError

MARKER = ".arcsplit-patches"
# Set to 1 in a process's environment, it switches the RPC patches off at run time (see docs/patches.md).
STOCK_ENV = "ARCSPLIT_RPC_STOCK"
SPIN_ENV = "ARCSPLIT_RPC_SPIN_US"  # patch 0005
# patch 0001: 0 in llama-server reads a local card's tensor into ordinary memory, not the card's page-locked host
# buffers, before it goes to an rpc-server (an A/B switch: bench/rpc_link.py, bench/throughput.py -nopin; on by default)
PINNED_ENV = "ARCSPLIT_RPC_PINNED"
# patches 0001, 0003 and 0007: 0 in llama-server waits for an activation's source before it goes to an rpc-server (its
# own CUDA or SYCL card in hybrid; the first rpc-server's reply in all-RPC's relay) instead of queueing the read and
# going on, and in an rpc-server waits for a repeated graph before its next command (an A/B switch: bench/throughput.py
# -syncread; on by default)
ASYNC_READ_ENV = "ARCSPLIT_RPC_ASYNC_READ"
# patches 0001, 0003, 0007 and 0009: 1 in llama-server announces an activation bound for an rpc-server before its data,
# so an rpc-server whose device can wait on a host word (CUDA) launches the graph that reads it first (an A/B switch:
# bench/throughput.py -gate; off by default until measured on a GPU)
GATE_ENV = "ARCSPLIT_RPC_GATE"
# patch 0003: 0 in an rpc-server waits for each SET_TENSOR's copy as stock does; on (the default), one outside a gated
# window is copied on the device's stream and not waited for (an A/B switch: bench/throughput.py -syncset)
QUEUED_SETS_ENV = "ARCSPLIT_RPC_QUEUED_SETS"
RELAY_ENV = "ARCSPLIT_RPC_RELAY_KIB"  # patch 0007: chunk (KiB) of an activation relayed between rpc-servers; 0: off
# patches 0001 and 0003, with GATE_ENV: a graph input set from llama-server's host memory goes gated from this many KiB
# up (a prompt's embeddings on all-RPC's first rpc-server; default 256, 0: every one)
GATE_HOST_ENV = "ARCSPLIT_RPC_GATE_HOST_KIB"
# what arcsplit sets GATE_HOST_ENV to when it turns gated sets on and the user set no size: 4 GiB, so no host input is
# gated (on one H100 gating a MoE's prompt embeddings cost 5 % of all-RPC prefill; on a dense model it gained 3 %)
GATE_HOST_NEVER_KIB = 4 << 20
# patch 0010: pieces of one KV tensor closer than this many KiB move as one span when llama-server saves or restores a
# sequence (its host prompt cache); 0: one call per piece, as stock does (default 64)
KV_GAP_ENV = "ARCSPLIT_KV_GAP_KIB"
# patch 0011: 0 in llama-server loads a cached prompt into the slot of a request with cache_prompt false, as stock does
# (it is dropped at once, and gone from the cache); on by default: such a request's slot starts empty
SKIP_LOAD_ENV = "ARCSPLIT_SKIP_UNUSED_LOAD"
# patch 0013: 1 in llama-server reserves its scheduler again whenever a sequence gets a new backend sampler chain
# (--backend-sampling: every request), as stock does; off by default: only when the graph may grow past the last
# reservation
SAMPLER_RESERVE_ENV = "ARCSPLIT_SAMPLER_RESERVE"
# patch 0014: 0 in llama-server copies a SET_TENSOR's data into a block of its own before it is sent, as stock does; on
# by default: one of 256 KiB or more (a prompt's embeddings on all-RPC's first rpc-server, a weight) goes from where
# it lies (an A/B switch: bench/rpc_link.py, bench/throughput.py -copyset)
IN_PLACE_ENV = "ARCSPLIT_RPC_IN_PLACE"
# patch 0003: 0 in an rpc-server receives a SET_TENSOR above 64 MiB (a weight sent over the link while loading) into a
# zero-filled block of its whole size, as stock does; on by default: in pieces, straight into the tensor where its
# buffer is host memory, else through the staging block (bench/time_to_ready.py --load --whole-sets)
SET_PIECES_ENV = "ARCSPLIT_RPC_SET_PIECES"
# patch 0015: 1 in llama-server puts the input layer (token embeddings) on layer 0's card when every layer is offloaded;
# off unless set (llama.cpp keeps it on the CPU). arcsplit sets it for all-RPC groups on a GPU backend or whose first
# card is on another host (Route.input_on_card; their plan holds the embeddings there); the user's 1 asks for it on
# any all-RPC group, 0 never (bench/throughput.py -hostembd, -cardembd)
INPUT_ON_CARD_ENV = "ARCSPLIT_INPUT_ON_CARD"
SHM_ENV = "ARCSPLIT_RPC_SHM"  # patch 0008: 1 in llama-server and an rpc-server on one host: shared-memory link
# patch 0008: what one such link holds in /dev/shm while it is open (a header page, then a 4 MiB ring each way)
SHM_LINK_BYTES = 4096 + 2 * (4 << 20)
_DIR = Path(__file__).resolve().parent.parent / "data" / "patches"


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    summary: str

    @property
    def text(self) -> bytes:
        return self.path.read_bytes()


@functools.cache
def patches() -> tuple[Patch, ...]:
    """The patch set, in the order it is applied (package data: read once per process)."""
    found = []
    for path in sorted(_DIR.glob("*.patch")):
        first = path.read_text(encoding="utf-8").splitlines()[0]
        found.append(Patch(path.stem, path, first.split(":", 1)[-1].strip()))
    return tuple(found)


@functools.cache
def digest() -> str:
    """One short hash over every patch's bytes: the build key and the tree marker carry it."""
    h = hashlib.sha256()
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.text + b"\0")
    return h.hexdigest()[:10]


def applied(src: Path) -> str | None:
    """The digest recorded in a tree by :func:`apply`, or None for a stock tree."""
    try:
        return (src / MARKER).read_text().split()[0]
    except (OSError, IndexError):
        return None


def _command(tool: str, patch: Path, src: Path) -> tuple[list[str], dict[str, str] | None]:
    if Path(tool).name == "patch":
        return [tool, "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(src), "-i", str(patch)], None
    # git apply outside a repository works like patch; the ceiling keeps it from finding an enclosing repo.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(src.resolve().parent))
    return [tool, "apply", "-p1", str(patch.resolve())], env


def apply(src: Path, log: Path) -> None:
    """Apply every patch to ``src`` in place and record the digest; a patch that does not apply is an error.

    A tree that already carries this patch set (its marker says so) is left as it is.
    """
    if applied(src) == digest():
        return
    tool = shutil.which("patch") or shutil.which("git")
    if tool is None:
        raise BuildError("applying arcsplit's llama.cpp patches needs `patch` or `git`, and neither is on PATH",
                         "apt-get install patch, or build the stock tree with --no-patches")
    for p in patches():
        cmd, env = _command(tool, p.path, src)
        with log.open("ab") as fh:
            fh.write(f"\n$ {shlex.join(cmd)}\n".encode())
            fh.flush()
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=src, env=env).returncode
        if rc != 0:
            raise BuildError(f"arcsplit patch {p.name} does not apply to {src} (log: {log})",
                             "this llama.cpp tree differs from the pinned one; build it with --no-patches")
    (src / MARKER).write_text(digest() + "\n" + "\n".join(p.name for p in patches()) + "\n")


def build_patches(bin_dir: Path) -> list[str] | None:
    """The patches a managed build was made with ([] for a stock build), None when unknown (not ours)."""
    try:
        lines = (bin_dir / MARKER).read_text().split()
    except OSError:
        return None
    if not lines:
        return None
    return [] if lines[:1] == ["stock"] else lines[1:]


def missing_note(bin_dir: Path) -> str | None:
    """A one-line hint when an RPC route runs on a build without arcsplit's current patches, else None."""
    have = build_patches(bin_dir)
    want = [p.name for p in patches()]
    if have == want:
        return None
    which = "a stock or unknown llama.cpp build" if not have else "an older arcsplit patch set"
    return (f"{bin_dir} is {which}: the RPC route runs without arcsplit's patches (on 2x H200 hybrid went from "
            "0.67x/0.82x/0.82x of native prefill/decode/4 streams to 0.90x/0.97x/0.93x with them, "
            "docs/patches.md); `arcsplit llama build --backend <yours>` makes a patched build")


@contextlib.contextmanager
def _environ_set(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def rpc_patches_switched(on: bool) -> contextlib.AbstractContextManager[None]:
    """Processes started inside run with the RPC patches on or off (they inherit STOCK_ENV): for A/B runs."""
    return _environ_set(STOCK_ENV, "0" if on else "1")


def rpc_link_polling(us: int) -> contextlib.AbstractContextManager[None]:
    """Groups started inside poll their RPC link up to ``us`` microseconds (0: off) before sleeping (patch 0005):
    arcsplit reads SPIN_ENV from the environment as the user's choice and passes it to every process."""
    return _environ_set(SPIN_ENV, str(max(0, us)))


def rpc_relay_chunks(kib: int) -> contextlib.AbstractContextManager[None]:
    """Groups started inside relay an activation between two rpc-servers in chunks of ``kib`` KiB (0: off, one
    get of the whole tensor and then one set, as stock does; patch 0007). Every process inherits RELAY_ENV."""
    return _environ_set(RELAY_ENV, str(max(0, kib)))


def _kib(environ: Mapping[str, str], name: str, default: str) -> int | None:
    """A size switch in KiB as the user set it, None when unset or empty (the patch's default). llama-server reads it
    itself, and takes a word it cannot parse as 0, silently: refused here before any process starts."""
    value = environ.get(name)
    if not value:
        return None
    if not value.strip().isdigit():
        raise BadInput(f"{name}={value!r} is not a number of KiB", f"set {name} to a whole number of KiB ({default})")
    return int(value)


def rpc_relay_kib(environ: Mapping[str, str] = os.environ) -> int | None:
    """The user's ARCSPLIT_RPC_RELAY_KIB (patch 0007), None when unset (the patch's default)."""
    return _kib(environ, RELAY_ENV, "1024 is the default; 0 relays whole tensors")


def rpc_gate_host_kib(environ: Mapping[str, str] = os.environ) -> int | None:
    """The user's ARCSPLIT_RPC_GATE_HOST_KIB (patches 0001 and 0003, with gated sets on), None when unset."""
    return _kib(environ, GATE_HOST_ENV, "256 is the default; 0 gates every graph input from host memory")


def kv_gap_kib(environ: Mapping[str, str] = os.environ) -> int | None:
    """The user's ARCSPLIT_KV_GAP_KIB (patch 0010), None when unset (the patch's default)."""
    return _kib(environ, KV_GAP_ENV, "64 is the default; 0 moves every run of KV cells on its own")


def _switch(environ: Mapping[str, str], name: str, default: bool, other: str) -> bool:
    """A patch's on/off switch as the user set it: `default` when unset or empty, else 0 or 1. Refused when it is
    neither: the patched processes would read a word they cannot parse as their own yes or no. `other` says what
    the value that is not the default does."""
    value = environ.get(name)
    if not value:
        return default
    if value.strip() not in ("0", "1"):
        raise BadInput(f"{name}={value!r} is neither 0 nor 1", f"set {name}={int(not default)} to {other}, or unset it")
    return value.strip() == "1"


def shm_link_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether llama-server and the rpc-servers of this host share memory for their link (patch 0008): on unless
    the user's ARCSPLIT_RPC_SHM says 0."""
    return _switch(environ, SHM_ENV, True, "link the rpc-servers of this host over loopback TCP")


def pinned_reads_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether llama-server reads its card into page-locked memory before an activation goes to an rpc-server
    (patch 0001): on unless the user's ARCSPLIT_RPC_PINNED says 0. llama-server reads it itself."""
    return _switch(environ, PINNED_ENV, True, "read the card into ordinary memory")


def async_reads_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether reads are queued instead of waited for: llama-server's read of an activation bound for an rpc-server
    (patches 0001 and 0007), and an rpc-server's read of a repeated graph's result, queued behind the graph (0003):
    on unless the user's ARCSPLIT_RPC_ASYNC_READ says 0. llama-server and the rpc-servers read it themselves."""
    return _switch(environ, ASYNC_READ_ENV, True,
                   "wait for every read's source (an activation bound for an rpc-server, an rpc-server's graph)")


def queued_sets_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an rpc-server queues a graph input's copy on its device instead of waiting for it (patch 0003): on
    unless the user's ARCSPLIT_RPC_QUEUED_SETS says 0. The rpc-servers read it themselves."""
    return _switch(environ, QUEUED_SETS_ENV, True, "wait for every set's copy on an rpc-server's device")


def gated_sets_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether llama-server announces an activation bound for an rpc-server before its data (gated sets): off
    unless the user's ARCSPLIT_RPC_GATE says 1, and refused when it is neither 0 nor 1. llama-server reads it."""
    return _switch(environ, GATE_ENV, False, "announce an activation before its data")


def unused_loads_skipped(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether llama-server leaves the host prompt cache alone for a request that reuses nothing (cache_prompt
    false; patch 0011): on unless the user's ARCSPLIT_SKIP_UNUSED_LOAD says 0. llama-server reads it itself."""
    return _switch(environ, SKIP_LOAD_ENV, True, "load a cached prompt for every request, as llama.cpp does")


def sampler_reserve_each_request(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether llama-server with backend sampling reserves its scheduler for every request's new sampler chain, as
    stock does (patch 0013): off unless the user's ARCSPLIT_SAMPLER_RESERVE says 1. llama-server reads it itself."""
    return _switch(environ, SAMPLER_RESERVE_ENV, False, "reserve the scheduler for every request, as llama.cpp does")


def sets_in_place(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether llama-server sends a big SET_TENSOR from where its data lies instead of a copy (patch 0014): on unless
    the user's ARCSPLIT_RPC_IN_PLACE says 0. llama-server reads it itself."""
    return _switch(environ, IN_PLACE_ENV, True, "copy every set's data before it is sent, as llama.cpp does")


def sets_in_pieces(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an rpc-server receives a SET_TENSOR above 64 MiB in pieces instead of into a block of its whole size
    (patch 0003): on unless the user's ARCSPLIT_RPC_SET_PIECES says 0. The rpc-servers read it themselves."""
    return _switch(environ, SET_PIECES_ENV, True, "receive each big set whole before its copy, as llama.cpp does")


def input_on_card(environ: Mapping[str, str] = os.environ) -> bool | None:
    """The user's choice of where an all-RPC group's token embeddings go (patch 0015): None when ARCSPLIT_INPUT_ON_CARD
    is unset (arcsplit decides per group: Route.input_on_card), 1 the first card, 0 llama-server's CPU. arcsplit sets
    it for llama-server itself (decide/specs.py)."""
    value = (environ.get(INPUT_ON_CARD_ENV) or "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise BadInput(f"{INPUT_ON_CARD_ENV}={value!r} is neither 0 nor 1",
                       f"set {INPUT_ON_CARD_ENV}=1 to hold an all-RPC group's token embeddings on its first card, 0 to "
                       "keep them on llama-server's CPU, or unset it to let arcsplit decide")
    return value == "1"


def check_switches(environ: Mapping[str, str] = os.environ) -> None:
    """Every patch switch llama.cpp's processes read themselves, checked before one starts: a value they cannot
    parse is refused here (BadInput), not taken silently as on or off. A new switch is added here only."""
    rpc_relay_kib(environ)
    rpc_gate_host_kib(environ)
    kv_gap_kib(environ)
    shm_link_on(environ)
    pinned_reads_on(environ)
    async_reads_on(environ)
    queued_sets_on(environ)
    gated_sets_on(environ)
    unused_loads_skipped(environ)
    sampler_reserve_each_request(environ)
    sets_in_place(environ)
    sets_in_pieces(environ)
    input_on_card(environ)


def kv_state_spans(kib: int) -> contextlib.AbstractContextManager[None]:
    """Groups started inside move a KV sequence saved or restored by llama-server's host prompt cache in spans that
    bridge gaps up to ``kib`` KiB (0: one call per run of cells, as stock; patch 0010): for A/B runs."""
    return _environ_set(KV_GAP_ENV, str(max(0, kib)))


def unused_prompt_loads(skip: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside skip (or, as stock, do) the load of a cached prompt into the slot of a request with
    cache_prompt false (patch 0011; llama-server inherits SKIP_LOAD_ENV): for A/B runs."""
    return _environ_set(SKIP_LOAD_ENV, "1" if skip else "0")


def rpc_async_reads(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside queue the read of an activation bound for an rpc-server and an rpc-server's read of
    its graph's result (on) or wait for their source first (off; patches 0001, 0003 and 0007, every process inherits
    ASYNC_READ_ENV): for A/B runs."""
    return _environ_set(ASYNC_READ_ENV, "1" if on else "0")


def rpc_queued_sets(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside queue an rpc-server's graph-input copies (on) or wait for each (off; patch 0003, every
    process inherits QUEUED_SETS_ENV): for A/B runs."""
    return _environ_set(QUEUED_SETS_ENV, "1" if on else "0")


@contextlib.contextmanager
def rpc_gated_sets(on: bool, host_kib: int | None = None) -> Iterator[None]:
    """Groups started inside announce an activation bound for an rpc-server before its data (on) or send it as
    before (off; patches 0001, 0003 and 0007, every process inherits GATE_ENV); ``host_kib``: a graph input from
    host memory goes gated from that size up (GATE_HOST_ENV; None: the patch's default): for A/B runs."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environ_set(GATE_ENV, "1" if on else "0"))
        if host_kib is not None:
            stack.enter_context(_environ_set(GATE_HOST_ENV, str(max(0, host_kib))))
        yield


def rpc_pinned_reads(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside read a local card's tensor into page-locked (on) or ordinary memory (off) before it
    goes to an rpc-server (patch 0001; every process inherits PINNED_ENV): for A/B runs."""
    return _environ_set(PINNED_ENV, "1" if on else "0")


def rpc_sets_in_place(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside send a big SET_TENSOR from where its data lies (on) or from a copy, as stock (off; patch
    0014, llama-server inherits IN_PLACE_ENV): for A/B runs."""
    return _environ_set(IN_PLACE_ENV, "1" if on else "0")


def rpc_sets_in_pieces(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside have their rpc-servers receive a set above 64 MiB in pieces (on) or whole, as stock (off;
    patch 0003, the rpc-servers inherit SET_PIECES_ENV): for A/B runs."""
    return _environ_set(SET_PIECES_ENV, "1" if on else "0")


def rpc_input_on_card(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups prepared inside hold an all-RPC group's token embeddings on its first card (on; patch 0015) or on
    llama-server's CPU as llama.cpp does (off), wherever the first card is: arcsplit reads INPUT_ON_CARD_ENV as the
    user's choice when it plans. For A/B runs."""
    return _environ_set(INPUT_ON_CARD_ENV, "1" if on else "0")


def rpc_shm_link(on: bool) -> contextlib.AbstractContextManager[None]:
    """Groups started inside link llama-server to the rpc-servers of this host through shared memory (patch 0008)
    or, off, over loopback TCP: arcsplit reads SHM_ENV from the environment as the user's choice."""
    return _environ_set(SHM_ENV, "1" if on else "0")
