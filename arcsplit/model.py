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

import os
import re
import struct
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

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
    token_embd_bytes: int  # stays on llama-server's CPU
    host_bytes: int  # token_embd and other input tensors: always on llama-server's CPU
    known_arch: bool
    compute_checked: bool = False  # the compute model was measured on this architecture's family (Family.checked)
    warnings: tuple[str, ...] = field(default=())
    ssm_d_inner: int = 0  # Mamba-2 mixer width (ssm.inner_size); the conv also carries 2 groups of state
    ffn_gate: bool = True  # the dense FFN has a gate (SwiGLU); False: up, activation, down (Nemotron-H's ReLU^2)

    @property
    def n_layer_main(self) -> int:
        """Layers the trunk runs (NextN/MTP blocks excluded): llama.cpp's n_layer()."""
        return self.n_layer - self.n_layer_nextn

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.output_bytes + self.host_bytes


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


def read_header(path: str | Path, shard: int = 0) -> Header:
    """Parse one GGUF file's header. Every malformed input becomes a one-line ModelError."""
    p = str(path)
    try:
        size = os.path.getsize(p)
        if os.path.exists(p) and not os.path.isfile(p) and not os.path.isdir(p):
            # a FIFO or device: open() would wait forever for a writer
            raise ModelError(f"{p} is not a regular file (a pipe or device?)", "pass the .gguf model file itself")
        f = open(p, "rb")
    except FileNotFoundError:
        raise ModelError(f"model file {p} does not exist", "check the path") from None
    except IsADirectoryError:
        raise ModelError(f"{p} is a directory, not a GGUF file", "pass the .gguf file") from None
    except OSError as exc:
        raise ModelError(f"cannot open model file {p}: {exc.strerror}", "check the file's permissions") from None
    with f:
        r = _Reader(f, p, size)
        if size < 24:
            raise ModelError(f"{p} is not a GGUF file (only {size} bytes)", "pass a .gguf model file")
        magic = r.u32()
        if magic != GGUF_MAGIC:
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
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string(MAX_KEY_BYTES, "a metadata key")
            vtype = r.u32()
            if key in meta:
                raise ModelError(f"{p}: metadata key {key!r} appears twice", "use a valid GGUF file")
            meta[key] = _read_value(r, vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = r.string(MAX_NAME_BYTES, "a tensor name")
            n_dims = r.u32()
            if n_dims == 0 or n_dims > MAX_DIMS:
                raise ModelError(f"{p}: tensor {name!r} has {n_dims} dimensions", "use a valid GGUF file")
            dims = r.take(struct.Struct(f"<{n_dims}Q"))
            gtype = r.u32()
            offset = r.u64()
            infos.append((name, dims, gtype, offset))
        align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelError(f"{p}: general.alignment {align!r} is not a power of two", "use a valid GGUF file")
        data_offset = -(-r.pos // align) * align
    tensors = []
    seen = set()
    for name, dims, gtype, offset in infos:
        if name in seen:
            raise ModelError(f"{p}: tensor {name!r} appears twice", "use a valid GGUF file")
        seen.add(name)
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
        tensors.append(TensorInfo(name, gtype, tuple(dims), n_bytes, offset, shard))
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

@dataclass(frozen=True)
class Family:
    """What one llama.cpp architecture does differently in memory (its ``load_hparams``), and whether arcsplit's
    compute-buffer model was measured on it.

    ``swa``: (default pattern, dense_first, default n_swa, SWA only when sliding_window > 0 is in the file).
    ``recurrent``: "all" (Mamba), "interval" (Qwen hybrids: full attention every ``full_attention_interval``),
    "rwkv" (every layer: token shifts and a WKV state; "rwkv6": the same with RWKV-6's time mix), "parallel" (every layer
    both attention with KV and a Mamba-2 mixer with state: Falcon-H1), "no_kv" (layers without KV heads are recurrent), "no_kv_ff" (those without KV heads and without an FFN:
    Nemotron-H's MLP layers have neither KV nor state), "" (none). ``kv_layers``: "first20" (gemma3n: only the first
    20 layers hold KV), "shared" (the last ``shared_kv_layers`` reuse earlier KV), "" (every attention layer).
    ``checked``: the compute model was measured against llama-fit-params on a model of this family
    (bench/plan_accuracy.py); on the others the planner adds ``memory.UNCHECKED_COMPUTE_MARGIN`` and says so.
    """

    swa: tuple[int, bool, int, bool] | None = None
    recurrent: str = ""
    mla: bool = False
    kv_layers: str = ""
    chunked_swa: bool = False
    swa_listed: bool = False  # SWA layers only from the per-layer sliding_window_pattern array (required)
    checked: bool = False
    ffn_gate: bool = True


_STANDARD = Family()
_CHECKED = Family(checked=True)
_QWEN_HYBRID = Family(recurrent="interval", checked=True)
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
    "gemma2": Family(swa=(2, False, 4096, False)),
    "gemma3": Family(swa=(6, False, 0, True), checked=True),
    "gemma-embedding": Family(swa=(6, False, 0, True)),
    "gemma3n": Family(swa=(5, False, 0, False), kv_layers="first20"),
    "gemma4": Family(kv_layers="shared", swa_listed=True),
    "cohere2": Family(swa=(4, False, 0, False)),
    "cohere2moe": Family(swa=(4, True, 0, False)),
    "gpt-oss": Family(swa=(2, False, 0, False)),
    "llama4": Family(swa=(4, False, 8192, False), chunked_swa=True),
    "exaone4": Family(swa=(4, False, 4096, True)),
    "exaone-moe": Family(swa=(4, False, 128, False)),
    "afmoe": Family(swa=(4, False, 0, True)),
    "olmo2": Family(swa=(4, False, 0, True)),
    "smallthinker": Family(swa=(4, True, 4096, True)),
    "plamo3": Family(swa=(8, False, 0, True)),
    "mellum": Family(swa=(4, False, 0, True)),
    "muse-glimmer": Family(swa=(4, False, 0, False)),
    "qwen35": _QWEN_HYBRID,
    "qwen35moe": _QWEN_HYBRID,
    "qwen3next": _QWEN_HYBRID,
    "qwen4exp": Family(recurrent="interval"),
    "deepseek2": Family(mla=True, checked=True),
    "granitehybrid": Family(recurrent="no_kv", checked=True),  # Mamba-2 layers where head_count_kv is 0
    "mamba": Family(recurrent="all", checked=True),
    "mamba2": Family(recurrent="all", checked=True),
    "rwkv7": Family(recurrent="rwkv", ffn_gate=False, checked=True),
    # Mamba-1 layers where head_count_kv is 0, attention elsewhere, experts or a dense FFN in every layer. Checked on
    # the bench's model and on Jamba-v0.1's layer shapes (4096 wide, 16 experts of 14336, vocab 65536); there, alone
    # on one card at -c 16384 (not 12288 or 24576), llama.cpp's allocator placed 22 MiB more than the formulas
    "jamba": Family(recurrent="no_kv", checked=True),
    "rwkv6": Family(recurrent="rwkv6", ffn_gate=False, checked=True),
    # Mamba-2, attention or MLP layers; which layers sit next to which moves split inputs between cards
    # (memory.hybrid_ssm_bounce)
    "nemotron_h": Family(recurrent="no_kv_ff", ffn_gate=False, checked=True),
    # attention and a Mamba-2 mixer side by side in every layer: each layer holds KV and recurrent state
    "falcon-h1": Family(recurrent="parallel", checked=True),
}


class _Meta:
    def __init__(self, meta: dict[str, Any], arch: str, path: str) -> None:
        self.meta, self.arch, self.path = meta, arch, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key.replace("{arch}", self.arch), default)

    def int(self, key: str, default: int | None = None) -> int | None:
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelError(f"{self.path}: {key.replace('{arch}', self.arch)} is {v!r}, not a number", "use a valid GGUF file")
        if v < 0 or v > 1 << 40:
            raise ModelError(f"{self.path}: {key.replace('{arch}', self.arch)} = {v} is absurd", "use a valid GGUF file")
        return int(v)

    def per_layer(self, key: str, n: int, default: int | tuple[int, ...]) -> tuple[int, ...]:
        """A scalar broadcast to every layer, or a per-layer array (llama.cpp's get_key_or_arr)."""
        v = self.get(key)
        if v is None:
            return default if isinstance(default, tuple) else (default,) * n
        if isinstance(v, tuple):
            if len(v) != n:
                raise ModelError(f"{self.path}: {key.replace('{arch}', self.arch)} has {len(v)} entries for {n} layers", "use a valid GGUF file")
            if any(x < 0 or x > 1 << 24 for x in v):
                raise ModelError(f"{self.path}: {key.replace('{arch}', self.arch)} holds absurd values", "use a valid GGUF file")
            return tuple(int(x) for x in v)
        if isinstance(v, StringArray):
            raise ModelError(f"{self.path}: {key.replace('{arch}', self.arch)} has {v.length} entries for {n} layers", "use a valid GGUF file")
        x = self.int(key)
        assert x is not None
        if x > 1 << 24:
            raise ModelError(f"{self.path}: {key.replace('{arch}', self.arch)} = {x} is absurd", "use a valid GGUF file")
        return (x,) * n


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


def profile_from_headers(headers: list[Header]) -> ModelProfile:
    first = headers[0]
    meta = first.metadata
    path = first.path
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{path} has no general.architecture", "use a GGUF model file (not a LoRA or vocab-only file)")
    m = _Meta(meta, arch, path)
    warnings: list[str] = []

    n_all = m.int("{arch}.block_count")
    if not n_all:
        raise ModelError(f"{path}: {arch}.block_count is missing or 0", "use a complete GGUF model file")
    if n_all > MAX_LAYERS:
        raise ModelError(f"{path}: {arch}.block_count = {n_all} is absurd", "use a valid GGUF file")
    n_nextn = m.int("{arch}.nextn_predict_layers", 0) or 0
    if n_nextn > n_all:
        raise ModelError(f"{path}: nextn_predict_layers {n_nextn} > block_count {n_all}", "use a valid GGUF file")
    n_main = n_all - n_nextn
    n_embd = m.int("{arch}.embedding_length", 0) or 0
    n_ctx_train = m.int("{arch}.context_length", 0) or 0

    # tensor table -> bytes per layer
    layer_bytes = [0] * n_all
    expert_bytes = [0] * n_all
    n_embd_q = [0] * n_all
    output_bytes = 0
    host_bytes = 0
    token_embd = None
    has_output = False
    for h in headers:
        for t in h.tensors:
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
    if tied:
        output_bytes += token_embd.n_bytes  # llama.cpp places a TENSOR_DUPLICATED copy on the output device
    if token_embd is None and not has_output:
        warnings.append("no token_embd.weight or output.weight tensor: the output layer is sized from what is there")

    n_vocab = m.int("{arch}.vocab_size")
    if n_vocab is None:
        if token_embd is not None and len(token_embd.shape) >= 2:
            n_vocab = token_embd.shape[1]
        else:
            toks = meta.get("tokenizer.ggml.tokens")
            n_vocab = toks.length if isinstance(toks, StringArray) else 0

    # attention shape (llama_model::load_hparams)
    n_head = m.per_layer("{arch}.attention.head_count", n_all, 0)
    n_head_kv = m.per_layer("{arch}.attention.head_count_kv", n_all, n_head)
    n_ff = m.per_layer("{arch}.feed_forward_length", n_all, 0)
    h0 = n_head[0] if n_head and n_head[0] else 0
    head_k = m.int("{arch}.attention.key_length", (n_embd // h0) if h0 else 0) or 0
    head_v = m.int("{arch}.attention.value_length", (n_embd // h0) if h0 else 0) or 0
    head_k_swa = m.int("{arch}.attention.key_length_swa", head_k) or 0
    head_v_swa = m.int("{arch}.attention.value_length_swa", head_v) or 0

    # sliding window
    n_swa = 0
    swa_chunked = False
    is_swa: tuple[bool, ...] = (False,) * n_all
    sw = m.int("{arch}.attention.sliding_window")
    pat = m.get("{arch}.attention.sliding_window_pattern")
    fam = FAMILIES.get(arch)
    rule = fam.swa if fam else None
    explicit = isinstance(pat, tuple) and bool(pat)
    if (fam and fam.swa_listed) or (explicit and rule is not None and (sw or 0) > 0) or (rule is None and explicit and sw):
        if not isinstance(pat, tuple) or len(pat) != n_all:
            raise ModelError(f"{path}: {arch}.attention.sliding_window_pattern must list {n_all} layers", "use a valid GGUF file")
        is_swa = tuple(bool(x) for x in pat)
        n_swa = sw or 0
    elif rule is not None:
        n_pattern, dense_first, n_swa_default, needs_key = rule
        if fam is not None and fam.chunked_swa and sw == 0:
            pass  # llama4 without chunked attention
        elif not needs_key or (sw or 0) > 0:
            n_swa = sw if sw is not None else n_swa_default
            n_pattern = m.int("{arch}.attention.sliding_window_pattern", n_pattern) or 0
            is_swa = _swa_pattern(n_pattern, dense_first, n_main, n_all)
            swa_chunked = fam is not None and fam.chunked_swa
    elif sw and isinstance(pat, int):
        n_swa = sw
        is_swa = _swa_pattern(int(pat), False, n_main, n_all)
        warnings.append(f"{arch}: sliding window taken from the GGUF keys (window {sw}, pattern {pat}), not verified for this architecture")
    if n_swa == 0:
        is_swa = (False,) * n_all

    # recurrent (hybrid) layers
    is_recr: tuple[bool, ...] = (False,) * n_all
    n_embd_r = n_embd_s = 0
    d_conv = m.int("{arch}.ssm.conv_kernel", 0) or 0
    d_inner = m.int("{arch}.ssm.inner_size", 0) or 0
    d_state = m.int("{arch}.ssm.state_size", 0) or 0
    n_group = m.int("{arch}.ssm.group_count", 0) or 0
    recurrent = fam.recurrent if fam else ""
    if recurrent or (d_inner and d_state):
        n_embd_r = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
        n_embd_s = d_state * d_inner
        if recurrent in ("rwkv", "rwkv6"):  # llama_hparams::n_embd_r/n_embd_s with wkv_head_size set
            n_embd_r = (m.int("{arch}.token_shift_count", 2) or 2) * n_embd
            n_embd_s = n_embd * (m.int("{arch}.wkv.head_size", 0) or 0)
        arr = m.get("{arch}.attention.recurrent_layers")
        if isinstance(arr, tuple):
            if len(arr) != n_all:
                raise ModelError(f"{path}: {arch}.attention.recurrent_layers must list {n_all} layers", "use a valid GGUF file")
            is_recr = tuple(bool(x) for x in arr)
        elif recurrent in ("all", "rwkv", "rwkv6", "parallel"):
            is_recr = (True,) * n_all
        elif recurrent == "interval":
            interval = m.int("{arch}.full_attention_interval", 4) or 4
            is_recr = tuple(il < n_main and (il + 1) % interval != 0 for il in range(n_all))
        elif recurrent == "no_kv_ff":
            is_recr = tuple(il < n_main and n_head_kv[il] == 0 and n_ff[il] == 0 for il in range(n_all))
        else:
            # jamba / granitehybrid / falcon-h1 style: a layer without KV heads is recurrent
            is_recr = tuple(n_head_kv[il] == 0 for il in range(n_all))
            if recurrent != "no_kv":
                warnings.append(f"{arch}: recurrent layers taken as those without KV heads (not verified for this "
                                "architecture)")
            recurrent = "no_kv"

    # MLA: K-only cache of width key_length * n_head_kv
    mla = m.get("{arch}.attention.key_length_mla") is not None and m.get("{arch}.attention.value_length_mla") is not None
    if fam and fam.mla and not mla and m.get("{arch}.attention.kv_lora_rank") is not None:
        warnings.append("deepseek2 GGUF without key_length_mla: an old conversion; KV is sized as full attention")

    # which layers hold KV
    n_kv_from_start = -1
    if fam and fam.kv_layers == "first20":
        n_kv_from_start = 20
    elif (fam and fam.kv_layers == "shared") or m.get("{arch}.attention.shared_kv_layers") is not None:
        n_kv_from_start = n_all - (m.int("{arch}.attention.shared_kv_layers", 0) or 0)
    has_kv = []
    for il in range(n_all):
        ok = n_kv_from_start < 0 or il < n_kv_from_start
        ok = ok and il < n_main and (recurrent == "parallel" or not is_recr[il]) and n_head_kv[il] > 0
        if recurrent == "all":
            ok = False
        has_kv.append(ok)
    k_width = []
    v_width = []
    for il in range(n_all):
        if not has_kv[il]:
            k_width.append(0)
            v_width.append(0)
            continue
        hk, hv = (head_k_swa, head_v_swa) if is_swa[il] else (head_k, head_v)
        k_width.append(hk * n_head_kv[il])
        v_width.append(0 if mla else hv * n_head_kv[il])

    n_expert = m.int("{arch}.expert_count", 0) or 0
    used = m.get("{arch}.expert_used_count")
    n_expert_used = max(used) if isinstance(used, tuple) and used else (m.int("{arch}.expert_used_count", 0) or 0)

    # without the key, experts are feed_forward_length wide (Mixtral as llama, jamba: ffn_gate_exps {n_embd, n_ff})
    n_ff_exp = m.per_layer("{arch}.expert_feed_forward_length", n_all, n_ff if n_expert else 0)
    n_shared = m.int("{arch}.expert_shared_count", 0) or 0
    n_ff_shexp = m.int("{arch}.expert_shared_feed_forward_length", 0) or (n_shared * max(n_ff_exp) if n_shared else 0)

    known = fam is not None
    if not known:
        warnings.insert(
            0,
            f"architecture {arch!r} is not modelled by arcsplit: weights come from the tensor table, KV assumes "
            "standard attention on every layer; check the plan with llama-fit-params",
        )
    if not any(has_kv) and not any(is_recr):
        warnings.append("no layer holds a KV cache or recurrent state according to the metadata")

    name = meta.get("general.name")
    return ModelProfile(
        path=path,
        shards=tuple(h.path for h in headers),
        arch=arch,
        name=name if isinstance(name, str) else None,
        file_bytes=sum(h.file_bytes for h in headers),
        n_layer=n_all,
        n_layer_nextn=n_nextn,
        n_embd=n_embd,
        n_vocab=int(n_vocab or 0),
        n_ctx_train=n_ctx_train,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_k=tuple(k_width),
        n_embd_v=tuple(v_width),
        has_kv=tuple(has_kv),
        is_swa=is_swa,
        is_recurrent=is_recr,
        n_swa=n_swa,
        swa_chunked=swa_chunked,
        mla=mla,
        ssm_conv_kernel=d_conv,
        n_embd_r=n_embd_r,
        n_embd_s=n_embd_s,
        n_ff=n_ff,
        n_embd_q=tuple(n_embd_q),
        recurrent_kind=recurrent if any(is_recr) else "",
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=max(n_ff_exp),
        n_ff_shexp=n_ff_shexp,
        layer_bytes=tuple(layer_bytes),
        expert_bytes=tuple(expert_bytes),
        output_bytes=output_bytes,
        tied_output=tied,
        token_embd_bytes=token_embd.n_bytes if token_embd is not None else 0,
        host_bytes=host_bytes,
        known_arch=known,
        compute_checked=fam is not None and fam.checked,
        warnings=tuple(warnings),
        ssm_d_inner=d_inner,
        ffn_gate=fam.ffn_gate if fam is not None else True,
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
    import hashlib

    try:
        parts = [hashlib.sha256(Path(__file__).read_bytes()).hexdigest()]
        for s in _shard_paths(p.resolve()):
            st = s.stat()
            parts.append(f"{s}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}")
    except OSError:
        return None  # a missing shard: let the reader name it
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _cache_file(key: str) -> Path:
    from ._dirs import cache_dir

    return cache_dir() / "profiles" / f"{key}.json"


def _cache_get(key: str) -> ModelProfile | None:
    import json
    from dataclasses import fields

    try:
        raw = json.loads(_cache_file(key).read_text(encoding="utf-8"))
        kw = {f.name: tuple(raw[f.name]) if isinstance(raw[f.name], list) else raw[f.name] for f in fields(ModelProfile)}
        return ModelProfile(**kw)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_put(key: str, profile: ModelProfile) -> None:
    from dataclasses import asdict

    from ._dirs import keep_json

    keep_json(_cache_file(key), asdict(profile))  # a read-only cache only costs speed
