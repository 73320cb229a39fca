"""GGUF header -> ModelProfile: what the planner needs to know about a model, read without touching tensor data.

Why not ``gguf.GGUFReader``: it memory-maps the file (good) but turns every tokenizer string into a numpy view,
which takes ~10 s on a 262k-vocab model, and it trusts every count and length in the file. This reader walks the
header with ``struct`` and the official ``gguf`` package's constants, skips big arrays by their sizes, guards every
count and length against the bytes that are actually there, and reads only as far as the header goes, so the
time to read a 50 GB model is the time to read its header.

The per-layer facts (which layers are SWA, recurrent, hold KV; head counts; K/V widths) follow the rules of
llama.cpp's ``llama_model::load_hparams`` (src/llama-model.cpp, src/models/*.cpp in the pinned tree) for the
architectures in ``FAMILIES``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from itertools import repeat
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from ._dirs import cache_dir, keep_json
from .errors import ModelError

SUPPORTED_VERSIONS = (2, 3)
MAX_HEADER_BYTES = 256 << 20  # real headers are < 10 MB (262k-token vocab: 6.5 MB); a forged length reads at most this
MAX_KEY_BYTES = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 64  # GGML_MAX_NAME
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_WINDOW = 16 << 20  # bytes of the header held at once
KEEP_STRING = 1 << 20  # longer string values are skipped unread
KEEP_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer arrays); longer ones only counted

_SCALAR = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_U64 = struct.Struct("<Q")
_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_BLK = re.compile(r"^blk\.(\d+)\.")
_EXPERT = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")
# Tensors llama.cpp puts on the output layer's device (LLM_TENSOR_LAYER_OUTPUT), by name prefix.
_OUTPUT_PREFIXES = ("output.", "output_norm", "cls.", "cls_", "enc.output_norm", "dec.output_norm")


@dataclass(frozen=True)
class StringArray:
    """A skipped array: only its length and element type are kept (tokenizer vocabularies, merges, scores)."""

    length: int
    item_type: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    n_bytes: int
    offset: int
    shard: int


@dataclass(frozen=True)
class Header:
    """One GGUF file's header: version, metadata, tensor table."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    file_bytes: int


@dataclass(frozen=True)
class ModelProfile:
    """Everything the planner needs about a model; per-layer tuples have ``n_layer`` entries (NextN included)."""

    path: str
    shards: tuple[str, ...]
    arch: str
    name: str | None
    file_bytes: int
    n_layer: int  # block_count: llama.cpp's n_layer_all, NextN/MTP layers included
    n_layer_nextn: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    n_embd_k: tuple[int, ...]  # K cache width per token of each layer (0 when the layer has no KV)
    n_embd_v: tuple[int, ...]  # V cache width (0 for MLA, which caches K only)
    has_kv: tuple[bool, ...]
    is_swa: tuple[bool, ...]
    is_recurrent: tuple[bool, ...]
    n_swa: int
    swa_chunked: bool
    mla: bool
    ssm_conv_kernel: int
    n_embd_r: int  # recurrent conv state per sequence (f32 elements)
    n_embd_s: int  # recurrent ssm state per sequence (f32 elements)
    n_ff: tuple[int, ...]
    n_embd_q: tuple[int, ...]  # width of each layer's query projection (attn_q rows; gated attention: 2x), 0: none
    recurrent_kind: str  # Family.recurrent: "all" (Mamba), "interval" (gated delta-net hybrids), "no_kv", ... ""
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # per routed expert
    n_ff_shexp: int  # all shared experts together
    layer_bytes: tuple[int, ...]  # weights of blk.N.* (NextN layers: loaded only with MTP)
    expert_bytes: tuple[int, ...]  # the part of layer_bytes in routed-expert tensors
    output_bytes: int  # output layer on its card: output.weight + output_norm (or the tied token_embd copy)
    tied_output: bool
    token_embd_bytes: int  # on llama-server's CPU, or the first card (PlanOptions.input_on_first)
    host_bytes: int  # token_embd and other input tensors: where token_embd goes
    known_arch: bool
    compute_checked: bool = False  # the compute model was measured on this architecture's family (Family.checked)
    warnings: tuple[str, ...] = field(default=())
    ssm_d_inner: int = 0  # Mamba-2 mixer width (ssm.inner_size); the conv also carries 2 groups of state
    ffn_gate: bool = True  # the dense FFN has a gate (SwiGLU); False: up, activation, down (Nemotron-H's ReLU^2)

    @property
    def n_layer_main(self) -> int:
        """Layers the trunk runs (NextN/MTP blocks excluded): llama.cpp's n_layer()."""
        return self.n_layer - self.n_layer_nextn


# ---------------------------------------------------------------------------------------------------------------
# the header reader


class _Reader:
    """Reads a file front to back through a window: never more than the header, never past the file.

    Only the bytes from ``pos`` on are kept (nothing behind it is read again), the window is at most
    ``MAX_WINDOW`` unless one string needs more, and skipped spans (big arrays, long strings) are never read:
    a forged length costs a seek, not memory.
    """

    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.buf = b""  # file bytes [base, base + len(buf))
        self.base = 0
        self.pos = 0

    def _check(self, end: int) -> None:
        if end > self.size:
            raise ModelError(
                f"{self.path}: the GGUF header is truncated or a length in it is forged (needs byte {end}, "
                f"file has {self.size})",
                "re-download the file; it is not a complete GGUF model",
            )
        if end > MAX_HEADER_BYTES:
            raise ModelError(f"{self.path}: the GGUF header claims more than {MAX_HEADER_BYTES >> 20} MiB (forged lengths?)", "use a valid GGUF file")

    def _fill(self, end: int) -> None:
        if end <= self.base + len(self.buf):
            return
        self._check(end)
        start = self.pos
        want = min(self.size, MAX_HEADER_BYTES, max(end, start + min(2 * len(self.buf), MAX_WINDOW), start + (1 << 20)))
        self.f.seek(start)
        self.buf = self.f.read(want - start)
        self.base = start
        if start + len(self.buf) < end:
            raise ModelError(f"{self.path}: the file ended while reading its header", "re-download the file")

    def skip(self, n: int) -> None:
        self._check(self.pos + n)
        self.pos += n

    def take(self, fmt: struct.Struct) -> tuple[Any, ...]:
        self._fill(self.pos + fmt.size)
        out = fmt.unpack_from(self.buf, self.pos - self.base)
        self.pos += fmt.size
        return out

    def u32(self) -> int:
        return self.take(_U32)[0]

    def u64(self) -> int:
        return self.take(_U64)[0]

    def string(self, limit: int, what: str) -> str | None:
        """The string, or None for one longer than KEEP_STRING (skipped unread: no key arcsplit reads is that long)."""
        n = self.u64()
        if n > limit:
            raise ModelError(f"{self.path}: {what} is {n} bytes long (forged length?)", "use a valid GGUF file")
        if n > KEEP_STRING:
            self.skip(n)
            return None
        self._fill(self.pos + n)
        raw = self.buf[self.pos - self.base : self.pos - self.base + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Walk ``count`` length-prefixed strings: runs of short ones in bulk (``_short_run``), the rest one by one.

        Exact either way: the bulk path only accepts steps whose lengths it has read, the slow path is the
        bounds-checked one. A 262k-token vocabulary takes ~5 ms instead of ~30 ms.
        """
        unpack = _U64.unpack_from
        o, left = self.pos, count
        slow = _SLOW_STEPS
        while left:
            if left >= _BULK_MIN:
                if o + 8 > self.base + len(self.buf):
                    self.pos = min(o, self.size)
                    self._fill(o + 8)
                k, rel = _short_run(self.buf, o - self.base, left)
                o, left = self.base + rel, left - k
                if k >= _SLOW_STEPS or not left:
                    slow = _SLOW_STEPS
                    continue
                slow *= 2  # the bulk path is not paying here (long, empty or odd strings): back off
            n = min(left, slow)
            left -= n
            while True:
                buf, base = self.buf, self.base
                try:
                    for _ in repeat(None, n):
                        o += 8 + unpack(buf, o - base)[0]
                        n -= 1
                    break
                except (struct.error, OverflowError):  # past the window, or a forged length past any window
                    self.pos = min(o, self.size)  # every string before o is done with
                    self._fill(o + 8)
        self._check(o)
        self.pos = o


_BULK_MIN = 64  # fewer strings than this are walked one by one
_SLOW_STEPS = 256  # strings walked one by one when the bulk path stops early; doubles while it keeps doing so
_BULK_BYTES = 1 << 17  # bytes the bulk path looks at per pass


def _short_run(buf: bytes, rel: int, left: int) -> tuple[int, int]:
    """Skip up to ``left`` strings shorter than 256 bytes starting at ``buf[rel]``, vectorized; (skipped, new rel).

    A string's 8-byte length < 256 is one byte followed by seven zeros. Every such spot in the next
    ``_BULK_BYTES`` is a candidate; a candidate chain from ``rel`` in which each next start is exactly
    ``start + 8 + length`` is the real walk (each step checked), and it stops at the first long, empty or odd string.
    """
    b = np.frombuffer(buf, np.uint8, min(len(buf) - rel, _BULK_BYTES, left * 264 + 16), rel)
    if len(b) < 16:
        return 0, rel
    z = b == 0
    z = z[:-1] & z[1:]
    z = z[:-2] & z[2:]
    z = z[:-3] & z[3:]  # z[i]: b[i .. i+6] are all zero
    c = np.flatnonzero(z[1:])  # b[c+1 .. c+7] zero: a length < 256 at c
    if not len(c) or c[0] != 0:
        return 0, rel
    nxt = c + 8 + b[c]
    bad = np.flatnonzero(nxt[:-1] != c[1:])
    k = min(int(bad[0]) if len(bad) else len(c) - 1, left)  # c[0 .. k] are verified starts
    return k, rel + int(c[k])


_U32 = struct.Struct("<I")


def _read_value(r: _Reader, vtype: int, key: str, depth: int = 0) -> Any:
    try:
        t = GGUFValueType(vtype)
    except ValueError:
        raise ModelError(f"{r.path}: metadata key {key!r} has unknown value type {vtype}", "use a valid GGUF file") from None
    if t in _SCALAR:
        fmt = struct.Struct("<" + _SCALAR[t])
        return r.take(fmt)[0]
    if t == GGUFValueType.STRING:
        return r.string(r.size, f"the value of {key!r}")
    # array
    if depth > 2:
        raise ModelError(f"{r.path}: metadata key {key!r} nests arrays too deeply", "use a valid GGUF file")
    itype = r.u32()
    n = r.u64()
    remaining = r.size - r.pos
    if itype == GGUFValueType.STRING:
        if n * 8 > remaining:
            raise ModelError(f"{r.path}: array {key!r} claims {n} strings (forged count?)", "use a valid GGUF file")
        r.skip_strings(n)
        return StringArray(n, itype)
    try:
        it = GGUFValueType(itype)
    except ValueError:
        raise ModelError(f"{r.path}: array {key!r} has unknown item type {itype}", "use a valid GGUF file") from None
    if it == GGUFValueType.ARRAY:
        if n > remaining // 12:
            raise ModelError(f"{r.path}: array {key!r} claims {n} items (forged count?)", "use a valid GGUF file")
        for _ in range(n):
            _read_value(r, itype, key, depth + 1)
        return StringArray(n, itype)
    code = _SCALAR[it]
    nbytes = n * struct.calcsize("<" + code)
    if nbytes > remaining:
        raise ModelError(f"{r.path}: array {key!r} claims {n} items (forged count?)", "use a valid GGUF file")
    if n > KEEP_ARRAY:
        r.skip(nbytes)
        return StringArray(n, itype)
    return r.take(struct.Struct(f"<{n}{code}"))


def _open_model(p: str) -> tuple[BinaryIO, int]:
    """The open file and its size; a missing file, a directory, a pipe or a permission problem is one line."""
    try:
        size = os.path.getsize(p)
        if os.path.exists(p) and not os.path.isfile(p) and not os.path.isdir(p):
            # a FIFO or device: open() would wait forever for a writer
            raise ModelError(f"{p} is not a regular file (a pipe or device?)", "pass the .gguf model file itself")
        return open(p, "rb"), size
    except FileNotFoundError:
        raise ModelError(f"model file {p} does not exist", "check the path") from None
    except IsADirectoryError:
        raise ModelError(f"{p} is a directory, not a GGUF file", "pass the .gguf file") from None
    except OSError as exc:
        raise ModelError(f"cannot open model file {p}: {exc.strerror}", "check the file's permissions") from None


def _read_preamble(r: _Reader) -> tuple[int, int, int]:
    """(version, tensor count, metadata key count), the counts checked against the bytes the file has."""
    p, size = r.path, r.size
    if size < 24:
        raise ModelError(f"{p} is not a GGUF file (only {size} bytes)", "pass a .gguf model file")
    if r.u32() != GGUF_MAGIC:
        raise ModelError(f"{p} is not a GGUF file (bad magic)", "pass a .gguf model file")
    version = r.u32()
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise ModelError(f"{p} is a big-endian GGUF", "convert it to little-endian GGUF")
        raise ModelError(
            f"{p} has unsupported GGUF version {version}",
            f"use GGUF version {' or '.join(map(str, SUPPORTED_VERSIONS))} (re-convert with a recent llama.cpp)",
        )
    n_tensors = r.u64()
    n_kv = r.u64()
    remaining = size - r.pos
    if n_kv > remaining // 13:
        raise ModelError(f"{p}: header claims {n_kv} metadata keys, more than the file can hold", "use a valid GGUF file")
    if n_tensors > remaining // 24:
        raise ModelError(f"{p}: header claims {n_tensors} tensors, more than the file can hold", "use a valid GGUF file")
    return version, n_tensors, n_kv


def _read_metadata(r: _Reader, n_kv: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string(MAX_KEY_BYTES, "a metadata key")
        assert key is not None  # MAX_KEY_BYTES < KEEP_STRING: a key is never skipped unread
        vtype = r.u32()
        if key in meta:
            raise ModelError(f"{r.path}: metadata key {key!r} appears twice", "use a valid GGUF file")
        meta[key] = _read_value(r, vtype, key)
    return meta


_RawTensor = tuple[str, tuple[int, ...], int, int]  # name, dims, ggml type, offset: as the header lists it


def _read_tensor_list(r: _Reader, n_tensors: int) -> list[_RawTensor]:
    infos = []
    for _ in range(n_tensors):
        name = r.string(MAX_NAME_BYTES, "a tensor name")
        assert name is not None  # MAX_NAME_BYTES < KEEP_STRING
        n_dims = r.u32()
        if n_dims == 0 or n_dims > MAX_DIMS:
            raise ModelError(f"{r.path}: tensor {name!r} has {n_dims} dimensions", "use a valid GGUF file")
        dims = r.take(struct.Struct(f"<{n_dims}Q"))
        gtype = r.u32()
        offset = r.u64()
        infos.append((name, dims, gtype, offset))
    return infos


def _tensor_info(p: str, raw: _RawTensor, align: int, data_offset: int, size: int, shard: int) -> TensorInfo:
    """One tensor's size from its type and shape, checked to lie inside the file."""
    name, dims, gtype, offset = raw
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
    except (ValueError, KeyError):
        raise ModelError(f"{p}: tensor {name!r} has unknown type {gtype}", "update llama.cpp/gguf or re-convert") from None
    n_el = 1
    for d in dims:
        if d <= 0 or d >= 1 << 62:
            raise ModelError(f"{p}: tensor {name!r} has dimension {d}", "use a valid GGUF file")
        n_el *= d
    if dims[0] % block:
        raise ModelError(f"{p}: tensor {name!r} row of {dims[0]} is not a multiple of its block size {block}", "use a valid GGUF file")
    n_bytes = n_el // block * type_size
    if offset % align or data_offset + offset + n_bytes > size:
        raise ModelError(
            f"{p}: tensor {name!r} lies outside the file (file truncated?)",
            "re-download the file; it is incomplete",
        )
    return TensorInfo(name, gtype, tuple(dims), n_bytes, offset, shard)


def read_header(path: str | Path, shard: int = 0) -> Header:
    """Parse one GGUF file's header. Every malformed input becomes a one-line ModelError."""
    p = str(path)
    f, size = _open_model(p)
    with f:
        r = _Reader(f, p, size)
        version, n_tensors, n_kv = _read_preamble(r)
        meta = _read_metadata(r, n_kv)
        infos = _read_tensor_list(r, n_tensors)
        align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelError(f"{p}: general.alignment {align!r} is not a power of two", "use a valid GGUF file")
        data_offset = -(-r.pos // align) * align
    tensors = []
    seen = set()
    for raw in infos:
        if raw[0] in seen:
            raise ModelError(f"{p}: tensor {raw[0]!r} appears twice", "use a valid GGUF file")
        seen.add(raw[0])
        tensors.append(_tensor_info(p, raw, align, data_offset, size, shard))
    return Header(p, version, meta, tuple(tensors), data_offset, size)


def _shard_paths(path: Path) -> list[Path]:
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1 or int(m.group("no")) < 1 or int(m.group("no")) > count:
        raise ModelError(f"{path.name} is not a valid split name", "name shards NAME-00001-of-0000N.gguf")
    return [path.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_headers(path: str | Path) -> list[Header]:
    """All shards of a model (one file for an unsplit model); a missing shard is named in the error."""
    p = Path(path)
    shards = _shard_paths(p)
    missing = [s.name for s in shards if not s.exists()]
    if missing and p.exists():
        raise ModelError(
            f"split model {p.name}: shard {', '.join(missing)} is missing from {p.parent}",
            "download every shard into the same folder",
        )
    headers = [read_header(s, i) for i, s in enumerate(shards)]
    if len(headers) > 1:
        count = headers[0].metadata.get("split.count")
        if count is not None and count != len(headers):
            raise ModelError(f"{shards[0].name} says split.count = {count}, but its name says {len(headers)}", "rename the shards")
        for i, h in enumerate(headers):
            no = h.metadata.get("split.no")
            if no is not None and no != i:
                raise ModelError(f"{Path(h.path).name} says it is shard {no + 1}, not {i + 1}", "rename or re-download the shards")
    return headers


# ---------------------------------------------------------------------------------------------------------------
# header -> profile

class Recurrent(StrEnum):
    """Which layers of a family carry recurrent state instead of (or, PARALLEL, beside) a KV cache; the value is
    ``ModelProfile.recurrent_kind``, which memory.py's compute model reads."""

    NONE = ""
    ALL = "all"  # Mamba: every layer, no KV
    INTERVAL = "interval"  # Qwen gated delta-net hybrids: full attention every full_attention_interval layers
    RWKV = "rwkv"  # every layer: token shifts and a WKV state
    RWKV6 = "rwkv6"  # the same with RWKV-6's time mix
    PARALLEL = "parallel"  # every layer both attention with KV and a Mamba-2 mixer with state (Falcon-H1)
    NO_KV = "no_kv"  # layers without KV heads are recurrent (Jamba, Granite hybrids)
    NO_KV_FF = "no_kv_ff"  # layers without KV heads and without an FFN (Nemotron-H: its MLP layers have neither)


class SwaRule(NamedTuple):
    """A family's sliding-window layout (llama_hparams::set_swa_pattern as its load_hparams calls it).

    This and the profile's intermediate records are NamedTuples, not frozen dataclasses: as immutable, and about
    2 ms less each to define when arcsplit starts (every command that plans imports this module)."""

    pattern: int  # one dense layer in every ``pattern`` (the file's sliding_window_pattern overrides it)
    dense_first: bool  # the dense layer opens each group (else it closes it)
    window: int  # n_swa when the file has no sliding_window key
    needs_key: bool  # SWA only when the file has sliding_window > 0


@dataclass(frozen=True)
class Family:
    """What one llama.cpp architecture does differently in memory (its ``load_hparams``), and whether arcsplit's
    compute-buffer model was measured on it.

    ``checked``: the compute model was measured against llama-fit-params on a model of this family
    (bench/plan_accuracy.py); on the others the planner adds ``memory.UNCHECKED_COMPUTE_MARGIN`` and says so.
    """

    swa: SwaRule | None = None
    recurrent: Recurrent = Recurrent.NONE
    mla: bool = False  # DeepSeek's multi-head latent attention: a K-only cache
    kv_first: int = 0  # only the first this many layers hold KV (gemma3n: 20); 0: every attention layer
    kv_shared: bool = False  # the last ``shared_kv_layers`` layers reuse earlier layers' KV (gemma4)
    chunked_swa: bool = False  # llama4's chunked attention: no window when the file says sliding_window 0
    swa_listed: bool = False  # SWA layers only from the per-layer sliding_window_pattern array (required)
    checked: bool = False
    ffn_gate: bool = True  # the dense FFN has a gate; False: up, activation, down


_STANDARD = Family()
_CHECKED = Family(checked=True)
_QWEN_HYBRID = Family(recurrent=Recurrent.INTERVAL, checked=True)
# Every architecture arcsplit models exactly (standard attention unless the row says otherwise).
FAMILIES: dict[str, Family] = {
    **{a: _STANDARD for a in (
        "llama-embed", "mistral3", "qwen2", "qwen2moe", "qwen3", "qwen2vl", "qwen3vl", "qwen3vlmoe",
        "gemma", "phi3", "phimoe", "granite", "granitemoe", "glm4", "glm4moe", "starcoder2", "internlm2",
        "command-r", "olmo", "olmoe", "stablelm", "smollm3", "ernie4_5", "ernie4_5-moe", "seed_oss", "hunyuan-moe",
        "hunyuan-dense", "minimax-m2", "dots1", "arcee", "apertus", "bailingmoe", "bailingmoe2", "grovemoe",
        "falcon", "baichuan", "xverse", "orion", "nemotron", "exaone", "bitnet", "chatglm", "dbrx", "arctic",
        "deepseek", "grok", "gptneox", "gpt2", "bloom", "mpt", "starcoder", "qwen", "phi2", "plamo", "codeshell",
        "minicpm", "jais", "jais2", "nanbeige", "maincoder", "pangu-embedded", "step35", "mimo2", "spark2_5",
        "talkie", "llada", "dream")},
    "llama": _CHECKED,
    "deci": _CHECKED,  # per-layer KV heads
    "qwen3moe": _CHECKED,
    "gemma2": Family(swa=SwaRule(2, False, 4096, False)),
    "gemma3": Family(swa=SwaRule(6, False, 0, True), checked=True),
    "gemma-embedding": Family(swa=SwaRule(6, False, 0, True)),
    "gemma3n": Family(swa=SwaRule(5, False, 0, False), kv_first=20),
    "gemma4": Family(kv_shared=True, swa_listed=True),
    "cohere2": Family(swa=SwaRule(4, False, 0, False)),
    "cohere2moe": Family(swa=SwaRule(4, True, 0, False)),
    "gpt-oss": Family(swa=SwaRule(2, False, 0, False)),
    "llama4": Family(swa=SwaRule(4, False, 8192, False), chunked_swa=True),
    "exaone4": Family(swa=SwaRule(4, False, 4096, True)),
    "exaone-moe": Family(swa=SwaRule(4, False, 128, False)),
    "afmoe": Family(swa=SwaRule(4, False, 0, True)),
    "olmo2": Family(swa=SwaRule(4, False, 0, True)),
    "smallthinker": Family(swa=SwaRule(4, True, 4096, True)),
    "plamo3": Family(swa=SwaRule(8, False, 0, True)),
    "mellum": Family(swa=SwaRule(4, False, 0, True)),
    "muse-glimmer": Family(swa=SwaRule(4, False, 0, False)),
    "qwen35": _QWEN_HYBRID,
    "qwen35moe": _QWEN_HYBRID,
    "qwen3next": _QWEN_HYBRID,
    "qwen4exp": Family(recurrent=Recurrent.INTERVAL),
    "deepseek2": Family(mla=True, checked=True),
    "granitehybrid": Family(recurrent=Recurrent.NO_KV, checked=True),  # Mamba-2 layers where head_count_kv is 0
    "mamba": Family(recurrent=Recurrent.ALL, checked=True),
    "mamba2": Family(recurrent=Recurrent.ALL, checked=True),
    "rwkv7": Family(recurrent=Recurrent.RWKV, ffn_gate=False, checked=True),
    # Mamba-1 layers where head_count_kv is 0, attention elsewhere, experts or a dense FFN in every layer. Checked on
    # the bench's model and on Jamba-v0.1's layer shapes (4096 wide, 16 experts of 14336, vocab 65536); there, alone
    # on one card at -c 16384 (not 12288 or 24576), llama.cpp's allocator placed 22 MiB more than the formulas
    "jamba": Family(recurrent=Recurrent.NO_KV, checked=True),
    "rwkv6": Family(recurrent=Recurrent.RWKV6, ffn_gate=False, checked=True),
    # Mamba-2, attention or MLP layers; which layers sit next to which moves split inputs between cards
    # (memory.hybrid_ssm_bounce)
    "nemotron_h": Family(recurrent=Recurrent.NO_KV_FF, ffn_gate=False, checked=True),
    # attention and a Mamba-2 mixer side by side in every layer: each layer holds KV and recurrent state
    "falcon-h1": Family(recurrent=Recurrent.PARALLEL, checked=True),
}
_UNKNOWN = Family()  # an architecture not in FAMILIES: standard attention on every layer, and a warning


class _Meta:
    """The metadata with ``{arch}`` in key names filled in, every number checked before the profile uses it."""

    def __init__(self, meta: dict[str, Any], arch: str, path: str) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def key(self, key: str) -> str:
        return key.replace("{arch}", self.arch)

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(self.key(key), default)

    def bad(self, key: str, what: str) -> ModelError:
        return ModelError(f"{self.path}: {self.key(key)} {what}", "use a valid GGUF file")

    def num(self, key: str, default: int | None = None) -> int | None:
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.bad(key, f"is {v!r}, not a number")
        if v < 0 or v > 1 << 40:
            raise self.bad(key, f"= {v} is absurd")
        return int(v)

    def count(self, key: str) -> int:
        """A size that is 0 when the file does not give it."""
        return self.num(key, 0) or 0

    def per_layer(self, key: str, n: int, default: int | tuple[int, ...]) -> tuple[int, ...]:
        """A scalar broadcast to every layer, or a per-layer array (llama.cpp's get_key_or_arr)."""
        v = self.get(key)
        if v is None:
            return default if isinstance(default, tuple) else (default,) * n
        if isinstance(v, tuple):
            if len(v) != n:
                raise self.bad(key, f"has {len(v)} entries for {n} layers")
            if any(x < 0 or x > 1 << 24 for x in v):
                raise self.bad(key, "holds absurd values")
            return tuple(int(x) for x in v)
        if isinstance(v, StringArray):
            raise self.bad(key, f"has {v.length} entries for {n} layers")
        x = self.num(key)
        assert x is not None
        if x > 1 << 24:
            raise self.bad(key, f"= {x} is absurd")
        return (x,) * n

    def layer_flags(self, key: str, n: int) -> tuple[bool, ...] | None:
        """A per-layer array of flags, None when the file has none."""
        v = self.get(key)
        if not isinstance(v, tuple):
            return None
        if len(v) != n:
            raise self.bad(key, f"must list {n} layers")
        return tuple(bool(x) for x in v)


class _Dims(NamedTuple):
    """The layer counts and per-layer shapes the family rules read."""

    n_all: int  # NextN layers included
    n_main: int
    n_embd: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]
    n_ff: tuple[int, ...]


class _Weights(NamedTuple):
    """The tensor table summed by where llama.cpp puts each tensor: its layer, the output card, the server's CPU."""

    layer_bytes: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    n_embd_q: tuple[int, ...]
    output_bytes: int
    host_bytes: int
    token_embd: TensorInfo | None
    tied: bool


class _Window(NamedTuple):
    n_swa: int
    chunked: bool
    is_swa: tuple[bool, ...]


class _Recurrence(NamedTuple):
    kind: Recurrent
    layers: tuple[bool, ...]
    n_embd_r: int
    n_embd_s: int
    d_conv: int
    d_inner: int


def _swa_pattern(n_pattern: int, dense_first: bool, n_main: int, n_all: int) -> tuple[bool, ...]:
    """llama_hparams::set_swa_pattern: NextN layers are never SWA."""
    out = []
    for il in range(n_all):
        if il >= n_main:
            out.append(False)
        elif dense_first:
            out.append(n_pattern == 0 or il % n_pattern != 0)
        else:
            out.append(n_pattern == 0 or il % n_pattern < n_pattern - 1)
    return tuple(out)


def _layer_counts(m: _Meta) -> tuple[int, int]:
    """(block_count, NextN layers): every per-layer array is checked against these."""
    n_all = m.num("{arch}.block_count")
    if not n_all:
        raise ModelError(f"{m.path}: {m.arch}.block_count is missing or 0", "use a complete GGUF model file")
    if n_all > MAX_LAYERS:
        raise ModelError(f"{m.path}: {m.arch}.block_count = {n_all} is absurd", "use a valid GGUF file")
    n_nextn = m.count("{arch}.nextn_predict_layers")
    if n_nextn > n_all:
        raise ModelError(f"{m.path}: nextn_predict_layers {n_nextn} > block_count {n_all}", "use a valid GGUF file")
    return n_all, n_nextn


def _weights(headers: list[Header], n_all: int, warnings: list[str]) -> _Weights:
    """Bytes per layer, on the output card and on the host, from every shard's tensor table."""
    path = headers[0].path
    layer_bytes, expert_bytes, n_embd_q = [0] * n_all, [0] * n_all, [0] * n_all
    output_bytes = host_bytes = 0
    token_embd = None
    has_output = False
    for t in (t for h in headers for t in h.tensors):
        mb = _BLK.match(t.name)
        if mb:
            il = int(mb.group(1))
            if il >= n_all:
                raise ModelError(f"{path}: tensor {t.name} names layer {il} of {n_all}", "use a valid GGUF file")
            layer_bytes[il] += t.n_bytes
            if _EXPERT.search(t.name):
                expert_bytes[il] += t.n_bytes
            elif t.name.endswith(".attn_q.weight") and len(t.shape) >= 2:
                n_embd_q[il] = t.shape[1]
        elif t.name.startswith(_OUTPUT_PREFIXES):
            output_bytes += t.n_bytes
            has_output = has_output or t.name == "output.weight"
        elif t.name.startswith("rope_freqs"):
            layer_bytes[0] += t.n_bytes  # created with layer 0 (its duplicates on other layers are tiny)
        else:
            host_bytes += t.n_bytes
            if t.name == "token_embd.weight":
                token_embd = t
    tied = not has_output and token_embd is not None
    if tied and token_embd is not None:
        output_bytes += token_embd.n_bytes  # llama.cpp places a TENSOR_DUPLICATED copy on the output device
    if token_embd is None and not has_output:
        warnings.append("no token_embd.weight or output.weight tensor: the output layer is sized from what is there")
    return _Weights(tuple(layer_bytes), tuple(expert_bytes), tuple(n_embd_q), output_bytes, host_bytes, token_embd, tied)


def _vocab_size(m: _Meta, token_embd: TensorInfo | None) -> int:
    """vocab_size, else the token embedding's rows, else the tokenizer's token count."""
    n_vocab = m.num("{arch}.vocab_size")
    if n_vocab is None:
        if token_embd is not None and len(token_embd.shape) >= 2:
            n_vocab = token_embd.shape[1]
        else:
            toks = m.meta.get("tokenizer.ggml.tokens")
            n_vocab = toks.length if isinstance(toks, StringArray) else 0
    return int(n_vocab or 0)


def _head_sizes(m: _Meta, d: _Dims) -> tuple[int, int, int, int]:
    """(K, V, K on SWA layers, V on SWA layers) per head: llama_model::load_hparams' defaults."""
    h0 = d.n_head[0] if d.n_head and d.n_head[0] else 0
    head_k = m.num("{arch}.attention.key_length", (d.n_embd // h0) if h0 else 0) or 0
    head_v = m.num("{arch}.attention.value_length", (d.n_embd // h0) if h0 else 0) or 0
    head_k_swa = m.num("{arch}.attention.key_length_swa", head_k) or 0
    head_v_swa = m.num("{arch}.attention.value_length_swa", head_v) or 0
    return head_k, head_v, head_k_swa, head_v_swa


def _family_window(m: _Meta, fam: Family, rule: SwaRule, sw: int | None, d: _Dims) -> _Window:
    """A family's own SWA layout: its pattern unless the file gives one, its window unless the file gives one."""
    if fam.chunked_swa and sw == 0:
        return _Window(0, False, ())  # llama4 without chunked attention
    if rule.needs_key and not (sw or 0) > 0:
        return _Window(0, False, ())
    n_pattern = m.num("{arch}.attention.sliding_window_pattern", rule.pattern) or 0
    is_swa = _swa_pattern(n_pattern, rule.dense_first, d.n_main, d.n_all)
    return _Window(sw if sw is not None else rule.window, fam.chunked_swa, is_swa)


def _sliding_window(m: _Meta, fam: Family, d: _Dims, warnings: list[str]) -> _Window:
    """Which layers use a sliding window, and its size: the family's rule, or a per-layer list in the file."""
    sw = m.num("{arch}.attention.sliding_window")
    pat = m.get("{arch}.attention.sliding_window_pattern")
    rule = fam.swa
    explicit = isinstance(pat, tuple) and bool(pat)
    if fam.swa_listed or (explicit and rule is not None and (sw or 0) > 0) or (rule is None and explicit and sw):
        listed = m.layer_flags("{arch}.attention.sliding_window_pattern", d.n_all)
        if listed is None:
            raise m.bad("{arch}.attention.sliding_window_pattern", f"must list {d.n_all} layers")
        window = _Window(sw or 0, False, listed)
    elif rule is not None:
        window = _family_window(m, fam, rule, sw, d)
    elif sw and isinstance(pat, int):
        window = _Window(sw, False, _swa_pattern(int(pat), False, d.n_main, d.n_all))
        warnings.append(f"{m.arch}: sliding window taken from the GGUF keys (window {sw}, pattern {pat}), not verified "
                        "for this architecture")
    else:
        window = _Window(0, False, ())
    if window.n_swa == 0:
        return _Window(0, window.chunked, (False,) * d.n_all)
    return window


def _every_layer(m: _Meta, d: _Dims) -> tuple[bool, ...]:
    return (True,) * d.n_all


def _interval_layers(m: _Meta, d: _Dims) -> tuple[bool, ...]:
    """Qwen hybrids: every ``full_attention_interval``-th trunk layer is attention, the others recurrent."""
    interval = m.num("{arch}.full_attention_interval", 4) or 4
    return tuple(il < d.n_main and (il + 1) % interval != 0 for il in range(d.n_all))


def _no_kv_ff_layers(m: _Meta, d: _Dims) -> tuple[bool, ...]:
    """Nemotron-H: the Mamba-2 layers are the trunk layers with neither KV heads nor an FFN."""
    return tuple(il < d.n_main and d.n_head_kv[il] == 0 and d.n_ff[il] == 0 for il in range(d.n_all))


def _no_kv_layers(m: _Meta, d: _Dims) -> tuple[bool, ...]:
    """Jamba, Granite hybrids: a layer without KV heads is recurrent."""
    return tuple(d.n_head_kv[il] == 0 for il in range(d.n_all))


# Which layers are recurrent, per kind, when the file has no attention.recurrent_layers list.
_RECURRENT_LAYERS = {
    Recurrent.ALL: _every_layer,
    Recurrent.RWKV: _every_layer,
    Recurrent.RWKV6: _every_layer,
    Recurrent.PARALLEL: _every_layer,
    Recurrent.INTERVAL: _interval_layers,
    Recurrent.NO_KV_FF: _no_kv_ff_layers,
    Recurrent.NO_KV: _no_kv_layers,
}


def _recurrence(m: _Meta, fam: Family, d: _Dims, warnings: list[str]) -> _Recurrence:
    """Recurrent layers and their per-sequence state sizes (llama_hparams::n_embd_r / n_embd_s). A family not known
    to be recurrent but with SSM sizes in its file is taken as "layers without KV heads are recurrent", with a
    warning."""
    d_conv = m.count("{arch}.ssm.conv_kernel")
    d_inner = m.count("{arch}.ssm.inner_size")
    d_state = m.count("{arch}.ssm.state_size")
    n_group = m.count("{arch}.ssm.group_count")
    kind = fam.recurrent
    if not kind and not (d_inner and d_state):
        return _Recurrence(kind, (False,) * d.n_all, 0, 0, d_conv, d_inner)
    n_embd_r = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    n_embd_s = d_state * d_inner
    if kind in (Recurrent.RWKV, Recurrent.RWKV6):  # with wkv_head_size set
        n_embd_r = (m.num("{arch}.token_shift_count", 2) or 2) * d.n_embd
        n_embd_s = d.n_embd * m.count("{arch}.wkv.head_size")
    layers = m.layer_flags("{arch}.attention.recurrent_layers", d.n_all)
    if layers is None:
        if kind is Recurrent.NONE:
            warnings.append(f"{m.arch}: recurrent layers taken as those without KV heads (not verified for this "
                            "architecture)")
            kind = Recurrent.NO_KV
        layers = _RECURRENT_LAYERS[kind](m, d)
    return _Recurrence(kind, layers, n_embd_r, n_embd_s, d_conv, d_inner)


def _mla(m: _Meta, fam: Family, warnings: list[str]) -> bool:
    """MLA: a K-only cache of width key_length * n_head_kv, when the file has the MLA head sizes."""
    mla = m.get("{arch}.attention.key_length_mla") is not None and m.get("{arch}.attention.value_length_mla") is not None
    if fam.mla and not mla and m.get("{arch}.attention.kv_lora_rank") is not None:
        warnings.append("deepseek2 GGUF without key_length_mla: an old conversion; KV is sized as full attention")
    return mla


def _kv_layers(m: _Meta, fam: Family, d: _Dims, rec: _Recurrence) -> tuple[bool, ...]:
    """Which layers hold a KV cache: trunk attention layers with KV heads, less those that reuse another's."""
    n_kv_from_start = -1
    if fam.kv_first:
        n_kv_from_start = fam.kv_first
    elif fam.kv_shared or m.get("{arch}.attention.shared_kv_layers") is not None:
        n_kv_from_start = d.n_all - m.count("{arch}.attention.shared_kv_layers")
    if rec.kind is Recurrent.ALL:
        return (False,) * d.n_all
    return tuple((n_kv_from_start < 0 or il < n_kv_from_start) and il < d.n_main
                 and (rec.kind is Recurrent.PARALLEL or not rec.layers[il]) and d.n_head_kv[il] > 0
                 for il in range(d.n_all))


def _kv_widths(heads: tuple[int, int, int, int], d: _Dims, has_kv: tuple[bool, ...], is_swa: tuple[bool, ...],
               mla: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K and V cache widths per token of each layer (0 without KV; V is 0 under MLA)."""
    head_k, head_v, head_k_swa, head_v_swa = heads
    k_width, v_width = [], []
    for il in range(d.n_all):
        hk, hv = (head_k_swa, head_v_swa) if is_swa[il] else (head_k, head_v)
        kv = d.n_head_kv[il] if has_kv[il] else 0
        k_width.append(hk * kv)
        v_width.append(0 if mla else hv * kv)
    return tuple(k_width), tuple(v_width)


def _experts(m: _Meta, d: _Dims) -> tuple[int, int, int, int]:
    """(experts, experts used per token, width of one routed expert, width of all shared experts together)."""
    n_expert = m.count("{arch}.expert_count")
    used = m.get("{arch}.expert_used_count")
    n_expert_used = max(used) if isinstance(used, tuple) and used else m.count("{arch}.expert_used_count")
    # without the key, experts are feed_forward_length wide (Mixtral as llama, jamba: ffn_gate_exps {n_embd, n_ff})
    n_ff_exp = m.per_layer("{arch}.expert_feed_forward_length", d.n_all, d.n_ff if n_expert else 0)
    n_shared = m.count("{arch}.expert_shared_count")
    n_ff_shexp = m.count("{arch}.expert_shared_feed_forward_length") or (n_shared * max(n_ff_exp) if n_shared else 0)
    return n_expert, n_expert_used, max(n_ff_exp), n_ff_shexp


def profile_from_headers(headers: list[Header]) -> ModelProfile:
    """The planner's view of a model: the family's rules (``FAMILIES``) applied to the first shard's metadata, and
    every shard's tensor table."""
    first = headers[0]
    arch = first.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{first.path} has no general.architecture", "use a GGUF model file (not a LoRA or vocab-only file)")
    m = _Meta(first.metadata, arch, first.path)
    fam = FAMILIES.get(arch, _UNKNOWN)
    warnings: list[str] = []
    n_all, n_nextn = _layer_counts(m)
    n_embd = m.count("{arch}.embedding_length")
    n_ctx_train = m.count("{arch}.context_length")
    w = _weights(headers, n_all, warnings)
    n_vocab = _vocab_size(m, w.token_embd)
    n_head = m.per_layer("{arch}.attention.head_count", n_all, 0)
    d = _Dims(n_all, n_all - n_nextn, n_embd, n_head, m.per_layer("{arch}.attention.head_count_kv", n_all, n_head),
              m.per_layer("{arch}.feed_forward_length", n_all, 0))
    heads = _head_sizes(m, d)
    window = _sliding_window(m, fam, d, warnings)
    rec = _recurrence(m, fam, d, warnings)
    mla = _mla(m, fam, warnings)
    has_kv = _kv_layers(m, fam, d, rec)
    n_embd_k, n_embd_v = _kv_widths(heads, d, has_kv, window.is_swa, mla)
    n_expert, n_expert_used, n_ff_exp, n_ff_shexp = _experts(m, d)
    if arch not in FAMILIES:
        warnings.insert(0, f"architecture {arch!r} is not modelled by arcsplit: weights come from the tensor table, KV "
                           "assumes standard attention on every layer; check the plan with llama-fit-params")
    if not any(has_kv) and not any(rec.layers):
        warnings.append("no layer holds a KV cache or recurrent state according to the metadata")
    name = first.metadata.get("general.name")
    return ModelProfile(
        path=first.path, shards=tuple(h.path for h in headers), arch=arch, name=name if isinstance(name, str) else None,
        file_bytes=sum(h.file_bytes for h in headers),
        n_layer=n_all, n_layer_nextn=n_nextn, n_embd=n_embd, n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        n_head=n_head, n_head_kv=d.n_head_kv, n_embd_k=n_embd_k, n_embd_v=n_embd_v, has_kv=has_kv,
        is_swa=window.is_swa, is_recurrent=rec.layers, n_swa=window.n_swa, swa_chunked=window.chunked, mla=mla,
        ssm_conv_kernel=rec.d_conv, n_embd_r=rec.n_embd_r, n_embd_s=rec.n_embd_s, n_ff=d.n_ff, n_embd_q=w.n_embd_q,
        recurrent_kind=rec.kind.value if any(rec.layers) else "",
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
        layer_bytes=w.layer_bytes, expert_bytes=w.expert_bytes, output_bytes=w.output_bytes, tied_output=w.tied,
        token_embd_bytes=w.token_embd.n_bytes if w.token_embd is not None else 0, host_bytes=w.host_bytes,
        known_arch=arch in FAMILIES, compute_checked=fam.checked, warnings=tuple(warnings),
        ssm_d_inner=rec.d_inner, ffn_gate=fam.ffn_gate,
    )


def served_name(profile: ModelProfile) -> str:
    """The name llama-server serves the model under (``--alias``; /v1/models, a client's ``model``): the GGUF's
    ``general.name``, else the file's stem (a split model's without its -0000N-of-0000M), never a path."""
    name = " ".join((profile.name or "").split())
    if name:
        return name
    file = Path(profile.path).name
    m = _SPLIT.match(file)
    return m.group("prefix") if m else Path(file).stem


def load_profile(path: str | Path, cache: bool = True) -> ModelProfile:
    """Read a GGUF model's header (all shards of a split model) into a ModelProfile. Reads no tensor data.

    Profiles are cached per file identity (path, size, mtime, inode of every shard, and this module's code):
    the header walk costs ~40 ms for a 262k-token vocabulary, a cached profile ~1 ms.
    """
    p = Path(path)
    if not p.exists():
        m = _SPLIT.match(p.name)
        raise ModelError(f"model file {p} does not exist", "check the path" + (" (and that every shard is there)" if m else ""))
    key = _cache_key(p) if cache else None
    if key is not None:
        hit = _cache_get(key)
        if hit is not None:
            return hit
    # any shard may be named; the profile points at the first, which is what llama-server wants
    profile = profile_from_headers(read_headers(p))
    if key is not None:
        _cache_put(key, profile)
    return profile


def _cache_key(p: Path) -> str | None:
    try:
        parts = [hashlib.sha256(Path(__file__).read_bytes()).hexdigest()]
        for s in _shard_paths(p.resolve()):
            st = s.stat()
            parts.append(f"{s}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}")
    except OSError:
        return None  # a missing shard: let the reader name it
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _cache_file(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


def _cache_get(key: str) -> ModelProfile | None:
    try:
        raw = json.loads(_cache_file(key).read_text(encoding="utf-8"))
        kw = {f.name: tuple(raw[f.name]) if isinstance(raw[f.name], list) else raw[f.name] for f in fields(ModelProfile)}
        return ModelProfile(**kw)  # type: ignore[arg-type]  # each field as asdict wrote it
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_put(key: str, profile: ModelProfile) -> None:
    keep_json(_cache_file(key), asdict(profile))  # a read-only cache only costs speed
