"""Parsers for llama-server and rpc-server log lines: buffer sizes, load progress, failure signatures.

Pure functions over text; the supervisor feeds them every captured line. Formats come from llama.cpp's own
printf calls (src/llama-model.cpp, llama-kv-cache.cpp, llama-context.cpp), from lines this build printed
(docs/llama-cpp-notes.md) and from users' reports (ggml-org/llama.cpp#22885, #27063, #25644).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping, Sequence

from ..route import SERVER

MiB = 1024 * 1024

# "load_tensors: RPC0[127.0.0.1:50153] model buffer size = 15.99 MiB"
# "llama_kv_cache:        CPU KV buffer size =    18.00 MiB", "sched_reserve:  RPC1[...] compute buffer size = ..."
_BUFFER = re.compile(
    r"(?P<func>\w+):\s+(?P<buf>\S+)\s+(?:(?P<extra>\w+)\s+)??(?P<kind>model|KV|compute|output|RS)\s+buffer size\s*=\s*"
    r"(?P<mib>[\d.]+)\s*MiB"
)
_ENDPOINT = re.compile(r"^(?P<name>[A-Za-z_]+\d*)\[(?P<endpoint>[^\]]+)\]$")
# "load_tensors: loading model tensors, this can take a while... (load_mode = mmap)"
_LOAD_MODE = re.compile(r"load_tensors: loading model tensors.*\(load_mode = (?P<mode>[\w+]+)\)")

# Failure signatures, most specific first. "alloc" is the Intel multi-device-context failure (NEO 25.44-26.22 on
# kernels < 7.1); "pinned_output" prints the same UR error 39, but at the first decode, while copying the output
# from a SYCL device other than 0 into pinned host memory that was allocated on device 0 (ggml-org/llama.cpp#28765,
# introduced by PR #26789, fixed by PR #28895; log form of #27063). Both fail in one context and not in hybrid.
_PINNED_OUTPUT = re.compile(r"in function ggml_backend_sycl_get_tensor_async\b|"
                            r"ggml_sycl_error \(func=\"ggml_backend_sycl_get_tensor_async\"")
_SIGNATURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("pinned_output", _PINNED_OUTPUT),
    ("alloc", re.compile(r"failed to allocate \S+ buffer|unable to allocate \S* ?buffer|"
                         r"error: 39 \(UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\)|Native API returns: 39\b")),
    # A card's driver faults, as the runtimes print them (verbatim lines: tests/fixtures/faults/SOURCES.md). After
    # "alloc": its UR error 39 and "failed to allocate X buffer" keep their kind and the one-context fallback.
    # Level Zero through SYCL/UR, Vulkan (vulkan.hpp's exception, ggml_vulkan, Mesa's anv and radv):
    ("device_lost", re.compile(r"UR_RESULT_ERROR_DEVICE_LOST|VK_ERROR_DEVICE_LOST|\bErrorDeviceLost\b|"
                               r"vk::DeviceLostError|ggml_vulkan: device lost|"
                               r"The CS has been cancelled because the context is lost")),
    # CUDA's sticky errors: the process's context is gone (cudaErrorIllegalAddress, cudaErrorLaunchFailure).
    ("device_error", re.compile(r"CUDA error: (?:an illegal memory access was encountered|"
                                r"unspecified launch failure)")),
    # The driver stopped a kernel that ran too long (cudaErrorLaunchTimeout, the display watchdog).
    ("hang", re.compile(r"CUDA error: the launch timed out and was terminated")),
    ("out_of_memory", re.compile(r"CUDA error: out of memory|cudaMalloc failed: out of memory|"
                                 r"\bErrorOutOfDeviceMemory\b|VK_ERROR_OUT_OF_DEVICE_MEMORY|"
                                 r"ggml_vulkan: Device memory allocation of size \d+ failed|"
                                 r"UR_RESULT_ERROR_OUT_OF_RESOURCES|PI_ERROR_OUT_OF_HOST_MEMORY")),
    ("rpc_connect", re.compile(r"Failed to connect to|RPC handshake failed")),
    ("rpc_crashed", re.compile(r"Remote RPC server crashed")),
    ("port_busy", re.compile(r"couldn't bind HTTP server socket|Failed to create server socket")),
    ("model", re.compile(r"error loading model|failed to load model")),
    # llama.cpp's argument parser (common/arg.cpp): the same arguments fail the same way on every start.
    ("bad_args", re.compile(r"^error: invalid argument: |^expected value for argument|"
                            r"^error while handling (?:argument|environment variable) ")),
)
# Patch 0008's warning when llama-server cannot make a link's rings (a full /dev/shm): that link runs over TCP.
_LINK_ON_TCP = re.compile(r"RPC: no shared-memory link \((?P<why>[^)]*)\); TCP only")
# ggml-sycl's switch that avoids pinned host memory, the workaround #28765 gives.
PINNED_OUTPUT_ENV = "GGML_SYCL_ENABLE_HOST_PINNED_MEM"


def pinned_output_line(text: str) -> str | None:
    """The deciding line of the #28765 failure in a log, or None."""
    m = _PINNED_OUTPUT.search(text)
    if m is None:
        return None
    end = text.find("\n", m.start())
    return text[text.rfind("\n", 0, m.start()) + 1:end if end >= 0 else len(text)].strip()


# The failures a one-context group hits and a hybrid group (llama-server on one card) avoids.
MULTI_DEVICE_KINDS = ("alloc", "pinned_output")
# The card faults a driver reports (why a generation ended, counted per card): looked for on their own, so that an
# out-of-memory at load is one even where "alloc" (its "failed to allocate CUDA0 buffer" line) is the failure kind.
FAULT_KINDS = ("device_lost", "device_error", "hang", "out_of_memory")
# "exited:": the line a member on another host gets when its host's agent goes ("node agent on b exited: ...").
_ERRORISH = re.compile(r"\berror\b|GGML_ASSERT|\bfailed\b|\babort|exception|Failed|\bexited:", re.IGNORECASE)


@dataclass(frozen=True)
class BufferLine:
    """One buffer allocation llama-server reports: which device buffer, what it holds, how many bytes."""

    kind: str  # "model" | "KV" | "compute" | "output" | "RS"
    buffer: str  # "RPC0", "CPU_Mapped", "SYCL0", ...
    endpoint: str | None  # "127.0.0.1:50153" for RPC buffers (names repeat across servers; endpoints don't)
    bytes: int

    @property
    def key(self) -> str:
        """Which buffer type: "RPC1[127.0.0.1:50153]" (the card's index on that rpc-server, which may hold several,
        and its endpoint), else the name ("SYCL0", "CPU_Mapped")."""
        return f"{self.buffer}[{self.endpoint}]" if self.endpoint else self.buffer


def parse_buffer_line(line: str) -> BufferLine | None:
    m = _BUFFER.search(line)
    if not m:
        return None
    buf = m.group("buf")
    endpoint = None
    em = _ENDPOINT.match(buf)
    if em:
        buf, endpoint = em.group("name"), em.group("endpoint")
    return BufferLine(kind=m.group("kind"), buffer=buf, endpoint=endpoint, bytes=int(float(m.group("mib")) * MiB))


# llama-server's load stages, as its load-progress reports name them (tools/server/server-context.cpp,
# load_progress_data): what each one loads, in words.
_LOAD_STAGES = {"spec_model": "the draft model (speculative decoding)", "mmproj_model": "the vision projector (mmproj)"}


def load_stage(stage: str | None, model: str | None = None) -> str:
    """What a load-progress report is loading: ``text_model`` is the served model's weights (named by its file),
    the others the draft model or the vision projector; an unknown stage by its own name."""
    if stage in (None, "", "text_model"):
        return f"the weights of {Path(model).name}" if model else "the model's weights"
    return _LOAD_STAGES.get(str(stage), str(stage))


def parse_load_mode(line: str) -> str | None:
    """The load mode ("mmap", "none", "dio", ...) of llama-server's "loading model tensors" line, else None."""
    m = _LOAD_MODE.search(line)
    return m.group("mode") if m else None


def load_mode_mmaps(mode: str) -> bool:
    """Whether llama.cpp loads through mmap in this load mode (src/llama-model-loader.cpp: mmap, mmap+mlock, auto)."""
    return mode in ("mmap", "mmap+mlock", "auto")


def load_progress(buffers: Sequence[BufferLine], value: float, mmap: bool = True) -> dict[str, tuple[int, int]]:
    """(bytes loaded, bytes) per model buffer key (BufferLine.key) at llama-server's load fraction ``value``.

    llama.cpp loads one buffer type after another, in the order it printed their model buffer sizes (its ctx_map,
    sorted by buffer type name: src/llama-model-loader.h ctx_key_comparator), and reports loaded / all weight
    bytes (llama-model-loader.cpp load_all_data); without mmap the device buffers go first (llama-model.cpp
    load_tensors, the stable_partition before "load tensor data"). So the fraction fills the buffers in that order.
    """
    model = [b for b in buffers if b.kind == "model"]
    if not mmap:
        model.sort(key=lambda b: b.buffer.startswith("CPU"))  # stable: device buffers first, each in print order
    left = max(0.0, min(1.0, value)) * sum(b.bytes for b in model)
    out: dict[str, tuple[int, int]] = {}
    for b in model:
        done = int(min(left, b.bytes))
        left -= done
        d, t = out.get(b.key, (0, 0))
        out[b.key] = (d + done, t + b.bytes)
    return out


def link_on_tcp(line: str) -> str | None:
    """Why a same-host RPC link stays on loopback TCP ("/dev/shm: No space left on device"), from patch 0008's
    warning in llama-server's log, or None."""
    m = _LINK_ON_TCP.search(line)
    return m.group("why") if m else None


def failure_kind(lines: Iterable[str]) -> str | None:
    """The first known failure signature in these lines (most specific first), or None."""
    lines = list(lines)
    for kind, pattern in _SIGNATURES:
        if any(pattern.search(line) for line in lines):
            return kind
    return None


def fault_kind(lines: Iterable[str]) -> str | None:
    """The first card fault (FAULT_KINDS, in the table's order) these lines report, or None."""
    lines = list(lines)
    for kind, pattern in _SIGNATURES:
        if kind in FAULT_KINDS and any(pattern.search(line) for line in lines):
            return kind
    return None


def deciding_lines(lines: Iterable[str], kind: str | None, limit: int = 4) -> list[str]:
    """What a failure message shows below its one line: the first line of signature ``kind`` and the lines after
    it (ggml prints the device and the call there), else the last lines that look like errors, else the last
    lines; blank lines skipped."""
    lines = [line.strip() for line in lines if line.strip()]
    pattern = dict(_SIGNATURES).get(kind or "")
    at = next((i for i, line in enumerate(lines) if pattern.search(line)), None) if pattern else None
    if at is not None:
        return lines[at:at + limit]
    return error_lines(lines, limit) or lines[-limit:]


# The device a fault names, as the process numbers the devices it sees: CUDA's "current device: 1" (ggml-cuda's
# CUDA_CHECK), ggml_vulkan's "device lost on Vulkan0".
_FAULT_DEVICE = re.compile(r"current device: (?P<n>\d+)|device lost on [A-Za-z]+(?P<v>\d+)")


def fault_position(lines: Iterable[str]) -> int | None:
    """The position among the process's own devices of the device a fault line names, or None."""
    for line in lines:
        m = _FAULT_DEVICE.search(line)
        if m:
            return int(m.group("n") or m.group("v"))
    return None


def bad_args_line(lines: Iterable[str]) -> str | None:
    """The line in which llama.cpp's argument parser refused an argument, or None."""
    pattern = dict(_SIGNATURES)["bad_args"]
    return next((line.strip() for line in lines if pattern.search(line)), None)


def error_lines(lines: Iterable[str], limit: int = 3) -> list[str]:
    """The last few lines that look like errors: what a one-line failure message should quote."""
    hits = [line.strip() for line in lines if _ERRORISH.search(line)]
    return hits[-limit:]


def sum_buffers(buffers: Iterable[BufferLine]) -> dict[str, dict[str, int]]:
    """Bytes per buffer key (BufferLine.key) and kind."""
    out: dict[str, dict[str, int]] = {}
    for b in buffers:
        slot = out.setdefault(b.key, {})
        slot[b.kind] = slot.get(b.kind, 0) + b.bytes
    return out


# -- which lines llama-server prints only because arcsplit runs it at -lv 4 ----------------------------------------
# arcsplit needs verbosity 4 (TRACE) for the buffer and load-mode lines above; llama-server's default is 3 (INFO).
# A TRACE line looks like an INFO one (both "I"), so `arcsplit logs` tells them apart by where they come from:
# libllama's info lines (no category tag: "load_tensors: ...", "print_info: ...") are TRACE in llama.cpp's common
# log (common/log.cpp common_log_get_verbosity), and the server's own are its SRV_TRC/SLT_TRC/COM_TRC/SPC_TRC
# calls, whose formats arcsplit/data/llama_trace.txt lists, read from the pinned tree (trace_formats).
TRACE_FILE = Path(__file__).resolve().parent.parent / "data" / "llama_trace.txt"
_LINE = re.compile(r"^\d+\.\d+\.\d+\.\d+ (?P<level>[A-Z]) (?P<msg>.*)$")
_TAGGED = re.compile(r"^(?P<cat>srv|slot|cmn|spec|que|res) +\S+: (?:id +-?\d+ \| task -?\d+ \| )?(?P<text>.*)$")
_TRC_CALL = re.compile(r"\b(?P<macro>SRV|SLT|COM|SPC)_TRC\(")
_CATEGORY = {"SRV": "srv", "SLT": "slot", "COM": "cmn", "SPC": "spec"}
_SPEC = re.compile(r"%[-+ #0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|z|j|t|L)?[diouxXeEfgGcspn]")


def _c_strings(text: str, i: int) -> tuple[str, int]:
    """The C string literal (adjacent literals and PRI macros joined) starting at ``text[i:]`` after blanks."""
    out: list[str] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        m = re.match(r'"((?:[^"\\]|\\.)*)"|PRI[diux](?:8|16|32|64)', text[i:])
        if m is None:
            return "".join(out), i
        out.append(m.group(1).encode().decode("unicode_escape") if m.group(1) is not None else "d")
        i += m.end()


def trace_formats(src: Path) -> list[str]:
    """``category<TAB>format`` of every TRACE call of the server and common code in a llama.cpp tree (first line of
    the format; a "%s" format with a literal argument is that literal)."""
    found: set[str] = set()
    for path in sorted([*src.glob("tools/server/*.cpp"), *src.glob("tools/server/*.h"), *src.glob("common/*.cpp")]):
        text = path.read_text(errors="replace")
        for m in _TRC_CALL.finditer(text):
            i = m.end()
            if m.group("macro") == "SLT":
                i = text.index(",", i) + 1  # the slot
            fmt, i = _c_strings(text, i)
            if fmt.startswith("%s") and text[i:i + 1] == ",":
                literal, _ = _c_strings(text, i + 1)
                fmt = literal or fmt
            first = fmt.split("\n", 1)[0]
            if len(_SPEC.sub("", first).strip()) >= 3:  # a bare "%s" would match every line
                found.add(f"{_CATEGORY[m.group('macro')]}\t{first}")
    return sorted(found)


@functools.lru_cache(maxsize=1)
def _trace_patterns() -> dict[str, re.Pattern[str]]:
    by_cat: dict[str, list[str]] = {}
    for line in TRACE_FILE.read_text(encoding="utf-8").splitlines():
        cat, _, fmt = line.partition("\t")
        parts = _SPEC.split(fmt.replace("%%", "\0"))
        if len(parts) > 1:  # up to the last value: a value with a newline ends the line there
            parts = parts[:-1] + [""]
        by_cat.setdefault(cat, []).append(".*?".join(re.escape(p).replace("\0", "%") for p in parts))
    return {cat: re.compile("|".join(f"(?:{p})" for p in pats)) for cat, pats in by_cat.items()}


def trace_filter() -> Callable[[str], bool]:
    """A predicate over llama-server's log lines in order: True for a line its default verbosity would not print.
    A line without llama.cpp's time prefix continues the one before (a multi-line message) and goes with it."""
    patterns = _trace_patterns()
    last = [False]

    def is_trace(line: str) -> bool:
        m = _LINE.match(line.rstrip("\r\n"))
        if m is None:
            return last[0]
        trace = False
        if m.group("level") == "I":
            tagged = _TAGGED.match(m.group("msg"))
            if tagged is None:
                trace = True  # libllama's info: TRACE in common's log
            else:
                pattern = patterns.get(tagged.group("cat"))
                trace = bool(pattern and pattern.match(tagged.group("text")))
        last[0] = trace
        return trace

    return is_trace


# -- what `arcsplit logs` and the dashboard leave out unless asked (--verbose) -----------------------------------
# Besides llama-server's TRACE lines: its child-protocol state lines (arcsplit opts into that protocol for the load
# progress, decide/specs.py ROUTER_PORT_ENV; llama-server's own router logs them at debug level only) and the blank
# line each brings; and every rpc-server's per-connection lines. ggml-rpc's client in llama-server opens a fresh
# connection for each query it makes while no buffer holds one open (the device list, each memory query: about a
# dozen per rpc-server in a load, none while serving), and the rpc-server logs each with two or three lines.
_CHATTER = re.compile(r"^(?:cmd_child_to_router:|Accepted client connection$|Client connection closed$"
                      r"|RPC: shared-memory link \()")


class QuietFilter:
    """The one filter of `arcsplit logs` and the dashboard's Logs tab: ``hides(process, line)``, fed one reader's
    lines of every process in arrival order, is True for a line neither shows without --verbose."""

    def __init__(self) -> None:
        self._server = trace_filter()  # a multi-line message's lines follow their first: one state per stream

    def hides(self, process: str, line: str) -> bool:
        text = line.rstrip("\r\n")
        if not text.strip() or _CHATTER.match(text):
            return True
        return process == SERVER and self._server(text)


def pick_lines(sources: Mapping[str, Iterable[str]], name: str | None, n: int, verbose: bool) -> list[str]:
    """What `logs` shows, of a running group (the supervisor's rings) or a finished one (its log files): the last
    ``n`` lines of process ``name``, or of each, prefixed ``[name]``; without ``verbose``, not what QuietFilter
    hides (llama-server's -lv 4 trace lines, the rpc-servers' per-connection lines)."""

    def lines(key: str) -> list[str]:
        got = list(sources.get(key, ()))
        if verbose:
            return got
        quiet = QuietFilter()
        return [line for line in got if not quiet.hides(key, line)]

    if name is not None:
        return lines(name)[-n:]
    out = []
    for key in list(sources):
        out += [f"[{key}] {line}" for line in lines(key)[-n:]]
    return out[-n:] if n else out
