"""Fuzz arcsplit's GGUF header reader: mutated headers in, a plan or a one-line ArcsplitError out.

    python bench/fuzz_gguf.py [--cases 100000] [--seed 1] [--bound 5] [--no-save]

Seeds are real files: the demo model (Gemma 3 270M) and the synthetic models arcsplit/synth.py writes (llama,
qwen3moe, gemma3, qwen35, deepseek2, a 3-shard llama). A case is a seed plus a short list of edits, most of them
aimed at the header's structural fields (counts, lengths, value types, dims, offsets) because a forged count or
length is what makes a naive reader allocate gigabytes or loop for hours. Each case's file is the mutated
header followed by the seed's tensor-data size as a sparse hole (no disk used), so mutations that keep the
header valid go on to make_plan.

Every case must end within ``--bound`` seconds (SIGALRM) in a plan or an ArcsplitError whose message is one line;
the process runs under an address-space limit, so a forged count that allocates shows up as MemoryError.
A case whose outcome signature (exception class + message with numbers and names blanked) was not seen before
is "interesting" and is saved to tests/corpus/gguf/cases.json, which tests/test_fuzz_gguf.py replays.
The module is also the library the tests use: seeds(), apply_ops(), run_case(), random_ops().
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import resource
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arcsplit.errors import ArcsplitError  # noqa: E402

CORPUS = ROOT / "tests" / "corpus" / "gguf"
RESULTS = ROOT / "bench" / "results" / "fuzz.md"
SYNTH_SEEDS = ("llama", "qwen3moe", "gemma3", "qwen35", "deepseek2", "sharded")
MiB = 1 << 20

# ---------------------------------------------------------------------------------------------------------------
# seeds: header bytes + where every structural field sits


@dataclass(frozen=True)
class Field:
    offset: int
    width: int  # 4 or 8 bytes, little-endian
    kind: str


@dataclass(frozen=True)
class SeedFile:
    name: str  # file name (shards keep their -0000i-of-0000N names)
    head: bytes  # bytes [0, data_offset): everything the reader may look at
    size: int  # the real file's size; the rest is a sparse hole
    fields: dict[str, tuple[Field, ...]]


@dataclass(frozen=True)
class Seed:
    name: str
    files: tuple[SeedFile, ...]  # files[0] is the path passed to load_profile

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.head)
            h.update(str(f.size).encode())
        return h.hexdigest()


_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def walk_fields(head: bytes) -> tuple[dict[str, tuple[Field, ...]], int]:
    """Offsets of every count, length and type field of a *valid* GGUF header; returns (fields, header end)."""
    out: dict[str, list[Field]] = {}

    def add(kind: str, off: int, width: int) -> None:
        out.setdefault(kind, []).append(Field(off, width, kind))

    u32 = lambda o: struct.unpack_from("<I", head, o)[0]  # noqa: E731
    u64 = lambda o: struct.unpack_from("<Q", head, o)[0]  # noqa: E731
    add("version", 4, 4)
    add("n_tensors", 8, 8)
    add("n_kv", 16, 8)
    n_tensors, n_kv = u64(8), u64(16)
    o = 24

    def value(o: int, vtype: int, in_array: bool) -> int:
        if vtype in _SCALAR_SIZE:
            n = _SCALAR_SIZE[vtype]
            if not in_array and n in (4, 8):
                add("scalar", o, n)
            return o + n
        if vtype == 8:  # string
            add("array_str_len" if in_array else "str_len", o, 8)
            return o + 8 + u64(o)
        if vtype == 9:  # array
            add("item_type", o, 4)
            add("array_len", o + 4, 8)
            itype, n = u32(o), u64(o + 4)
            o += 12
            if itype in _SCALAR_SIZE and itype != 8:
                return o + n * _SCALAR_SIZE[itype]
            for _ in range(n):
                o = value(o, itype, True)
            return o
        raise ValueError(f"seed has value type {vtype}")

    for _ in range(n_kv):
        add("key_len", o, 8)
        o += 8 + u64(o)
        add("value_type", o, 4)
        vtype = u32(o)
        o = value(o + 4, vtype, False)
    for _ in range(n_tensors):
        add("name_len", o, 8)
        o += 8 + u64(o)
        add("n_dims", o, 4)
        nd = u32(o)
        o += 4
        for _ in range(nd):
            add("dim", o, 8)
            o += 8
        add("ggml_type", o, 4)
        add("tensor_offset", o + 4, 8)
        o += 12
    return {k: tuple(v) for k, v in out.items()}, o


def _seed_file(path: Path) -> SeedFile:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(min(size, 64 * MiB))
    fields, end = walk_fields(raw)
    return SeedFile(path.name, raw[:end], size, fields)


def _write_synth(kind: str, folder: Path) -> Path:
    from arcsplit import synth

    writers = {"llama": synth.write_llama, "qwen3moe": synth.write_qwen3moe, "gemma3": synth.write_gemma3,
               "qwen35": synth.write_qwen35, "deepseek2": synth.write_deepseek2}
    if kind == "sharded":
        return synth.write_sharded_llama(folder / "sharded.gguf", n_shards=3, n_vocab=320)
    return writers[kind](folder / f"{kind}.gguf", n_vocab=320, header_only=True)


def seed_from_paths(name: str, first: Path) -> Seed:
    from arcsplit.model import _shard_paths

    return Seed(name, tuple(_seed_file(p) for p in _shard_paths(first)))


def demo_path() -> Path:
    from arcsplit.demo import ensure_demo_model

    return Path(ensure_demo_model())


def build_seeds(include_demo: bool = True) -> dict[str, Seed]:
    """Write the synthetic models to a temp dir and read back their headers (plus the demo model's)."""
    seeds = {}
    with tempfile.TemporaryDirectory(prefix="arcsplit-fuzz-seeds-") as tmp:
        for kind in SYNTH_SEEDS:
            first = _write_synth(kind, Path(tmp) / kind)
            seeds[kind] = seed_from_paths(kind, first)
    if include_demo:
        seeds["demo"] = seed_from_paths("demo", demo_path())
    return seeds


def save_seeds(seeds: dict[str, Seed], folder: Path) -> None:
    """Synthetic seeds go into the corpus (a few KB gzipped), so replays don't depend on today's synth.py."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in seeds.values():
        if s.name == "demo":
            continue  # 6.5 MB header: the corpus names it by hash; the demo package pins the file
        data = {"name": s.name, "files": [{"name": f.name, "size": f.size, "head": f.head.hex()} for f in s.files]}
        (folder / f"{s.name}.json.gz").write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))


def load_seeds(folder: Path = CORPUS / "seeds", demo: Path | None = None) -> dict[str, Seed]:
    seeds = {}
    for p in sorted(folder.glob("*.json.gz")):
        data = json.loads(gzip.decompress(p.read_bytes()))
        files = []
        for f in data["files"]:
            head = bytes.fromhex(f["head"])
            files.append(SeedFile(f["name"], head, f["size"], walk_fields(head)[0]))
        seeds[data["name"]] = Seed(data["name"], tuple(files))
    if demo is not None:
        seeds["demo"] = seed_from_paths("demo", demo)
    return seeds


# ---------------------------------------------------------------------------------------------------------------
# mutations: a case is (seed, file index, ops); ops are plain lists so they store as JSON

FIELD_KINDS = ("version", "n_tensors", "n_kv", "key_len", "value_type", "str_len", "scalar", "item_type", "array_len",
               "array_str_len", "name_len", "n_dims", "dim", "ggml_type", "tensor_offset")
INTERESTING = (0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 1 << 32, 1 << 40, 1 << 48, (1 << 62) - 1, 1 << 62, 1 << 63, (1 << 64) - 1)


def apply_ops(f: SeedFile, ops: list[list[Any]]) -> tuple[bytes, int]:
    """The mutated header and the mutated file size. Positions and indices wrap, so any ints are valid ops."""
    b = bytearray(f.head)
    size = f.size
    for op in ops:
        kind = op[0]
        n = max(len(b), 1)
        if not b and kind in ("byte", "flip", "delete", "dup", "field"):
            continue  # nothing left to edit
        if kind == "field":  # ["field", kind_index, field_index, value-or-delta, how]
            kinds = [k for k in FIELD_KINDS if k in f.fields]
            fk = kinds[op[1] % len(kinds)]
            fl = f.fields[fk][op[2] % len(f.fields[fk])]
            if fl.offset + fl.width > len(b):
                continue
            old = int.from_bytes(b[fl.offset: fl.offset + fl.width], "little")
            v = {"set": op[3], "add": old + op[3], "sub": old - op[3], "mul": old * max(op[3], 2)}[op[4]]
            b[fl.offset: fl.offset + fl.width] = (v % (1 << (8 * fl.width))).to_bytes(fl.width, "little")
        elif kind == "byte":  # ["byte", pos, value]
            b[op[1] % n] = op[2] & 0xFF
        elif kind == "flip":  # ["flip", pos, bit]
            b[op[1] % n] ^= 1 << (op[2] % 8)
        elif kind == "insert":  # ["insert", pos, hex]
            p = op[1] % (len(b) + 1)
            b[p:p] = bytes.fromhex(op[2])
            size += len(op[2]) // 2
        elif kind == "delete":  # ["delete", pos, count]
            p = op[1] % n
            k = min(op[2] % 64 + 1, len(b) - p)
            del b[p: p + k]
            size -= k
        elif kind == "dup":  # ["dup", pos, count]: repeat a chunk (duplicate keys, tensors)
            p = op[1] % n
            chunk = bytes(b[p: p + op[2] % 256 + 1])
            b[p:p] = chunk
            size += len(chunk)
        elif kind == "eof":  # ["eof", pos]: the file ends inside the header
            p = op[1] % (len(b) + 1)
            del b[p:]
            size = p
        elif kind == "shrink":  # ["shrink", bytes]: tensor data cut short
            size = max(len(b), size - op[1])
    return bytes(b), max(0, min(size, 1 << 40))


def random_ops(rng: random.Random, f: SeedFile) -> list[list[Any]]:
    ops: list[list[Any]] = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        r = rng.random()
        if r < 0.6:
            how = rng.choice(("set", "set", "set", "add", "sub", "mul"))
            v = rng.choice(INTERESTING) if how == "set" and rng.random() < 0.8 else rng.randrange(1, 1 << rng.choice((2, 8, 16, 32, 64)))
            ops.append(["field", rng.randrange(1 << 16), rng.randrange(1 << 30), v, how])
        elif r < 0.72:
            ops.append(["flip", rng.randrange(1 << 30), rng.randrange(8)])
        elif r < 0.8:
            ops.append(["byte", rng.randrange(1 << 30), rng.randrange(256)])
        elif r < 0.85:
            ops.append(["insert", rng.randrange(1 << 30), os.urandom(rng.choice((1, 4, 8, 13))).hex()])
        elif r < 0.9:
            ops.append(["delete", rng.randrange(1 << 30), rng.randrange(64)])
        elif r < 0.94:
            ops.append(["dup", rng.randrange(1 << 30), rng.randrange(256)])
        elif r < 0.97:
            ops.append(["eof", rng.randrange(1 << 30)])
        else:
            ops.append(["shrink", rng.randrange(1, 1 << 24)])
    return ops


# ---------------------------------------------------------------------------------------------------------------
# running one case


class CaseTimeout(Exception):
    pass


@dataclass(frozen=True)
class Outcome:
    kind: str  # "plan" | "error" | "crash" | "timeout"
    detail: str  # exception class and one-line message, or the plan's shape
    seconds: float

    @property
    def ok(self) -> bool:
        return self.kind in ("plan", "error")

    @property
    def signature(self) -> str:
        """What makes an outcome new: the message with paths, quoted names and numbers blanked."""
        s = re.sub(r"/\S+", "P", self.detail)
        s = re.sub(r"'[^']*'", "Q", s)
        s = re.sub(r"\d+(\.\d+)?", "N", s)
        return f"{self.kind}:{s}"


def _rig():
    from arcsplit.rig import Card, Rig

    return Rig(cards=(Card("cpu", 0, "fuzz0", 4096 * MiB, 4096 * MiB), Card("cpu", 1, "fuzz1", 4096 * MiB, 4096 * MiB)))


def write_case(folder: Path, seed: Seed, file_index: int, ops: list[list[Any]]) -> Path:
    """Write every file of the seed (the chosen one mutated) into ``folder``; return what to pass to the reader."""
    file_index %= len(seed.files)
    for i, f in enumerate(seed.files):
        head, size = apply_ops(f, ops) if i == file_index else (f.head, f.size)
        p = folder / f.name
        with open(p, "wb") as fh:
            fh.write(head[:size])
            if size > len(head):
                fh.truncate(size)  # sparse: the tensor data is a hole
    return folder / seed.files[0].name


def run_file(path: Path, bound: float = 5.0) -> Outcome:
    """load_profile + make_plan on one file, under a SIGALRM time bound."""
    from arcsplit.model import load_profile
    from arcsplit.planner import PlanOptions, make_plan

    def on_alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, bound)
    t0 = time.perf_counter()
    try:
        profile = load_profile(path, cache=False)
        plan = make_plan(profile, _rig(), PlanOptions(), devices=["RPC0", "RPC1"])
        kind, detail = "plan", f"{profile.arch} {plan.n_layer} layers ctx {plan.n_ctx}"
    except CaseTimeout:
        kind, detail = "timeout", f"over {bound} s"
    except ArcsplitError as exc:
        msg = str(exc)
        kind = "error" if msg and "\n" not in msg else "crash"
        detail = f"{type(exc).__name__}: {msg}"
    except BaseException as exc:  # noqa: BLE001 - everything else is the bug this hunts for
        if isinstance(exc, KeyboardInterrupt):
            raise
        kind, detail = "crash", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(kind, detail.replace(str(path.parent), "DIR")[:500], time.perf_counter() - t0)


def run_case(folder: Path, seed: Seed, file_index: int, ops: list[list[Any]], bound: float = 5.0) -> Outcome:
    return run_file(write_case(folder, seed, file_index, ops), bound)


# ---------------------------------------------------------------------------------------------------------------
# the corpus


def load_corpus(path: Path = CORPUS / "cases.json") -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []


def save_corpus(cases: list[dict[str, Any]], path: Path = CORPUS / "cases.json") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cases, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------------------------
# the run


def _limit_memory(extra: int) -> int:
    """Cap the address space at what we use now plus ``extra`` bytes: an allocation from a forged count fails."""
    import psutil

    cap = psutil.Process().memory_info().vms + extra
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bound", type=float, default=5.0, help="seconds a case may take")
    ap.add_argument("--demo-share", type=float, default=0.03, help="share of cases seeded from the demo model")
    ap.add_argument("--memory-mib", type=int, default=1024, help="address space allowed beyond the start")
    ap.add_argument("--no-save", action="store_true", help="do not update tests/corpus/gguf")
    args = ap.parse_args()

    import psutil

    # The corpus keeps the synthetic seeds it was made from, so stored cases replay byte for byte.
    if list((CORPUS / "seeds").glob("*.json.gz")):
        seeds = load_seeds(CORPUS / "seeds", demo_path() if args.demo_share > 0 else None)
    else:
        seeds = build_seeds(include_demo=args.demo_share > 0)
        if not args.no_save:
            save_seeds(seeds, CORPUS / "seeds")
    synth_names = [n for n in seeds if n != "demo"]
    rng = random.Random(args.seed)
    corpus = load_corpus()
    seen = {c["signature"] for c in corpus}
    counts: Counter[str] = Counter()
    per_seed: Counter[str] = Counter()
    sigs: Counter[str] = Counter()
    bad: list[dict[str, Any]] = []
    max_t, max_case = 0.0, None
    rss0 = psutil.Process().memory_info().rss
    cap = _limit_memory(args.memory_mib * MiB)
    t_start = time.time()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="arcsplit-fuzz-", dir=shm) as tmp:
        folder = Path(tmp)
        for i in range(args.cases):
            name = "demo" if "demo" in seeds and rng.random() < args.demo_share else rng.choice(synth_names)
            seed = seeds[name]
            fi = rng.randrange(len(seed.files)) if rng.random() < 0.3 else 0
            ops = random_ops(rng, seed.files[fi % len(seed.files)])
            out = run_case(folder, seed, fi, ops, args.bound)
            counts[out.kind] += 1
            per_seed[name] += 1
            sigs[out.signature] += 1
            if out.seconds > max_t:
                max_t, max_case = out.seconds, (name, fi, ops, out.detail)
            case = {"seed": name, "seed_sha256": seed.sha256, "file": fi, "ops": ops, "outcome": out.kind,
                    "detail": out.detail, "signature": out.signature}
            if not out.ok:
                bad.append(case)
            if out.signature not in seen and not args.no_save:
                seen.add(out.signature)
                corpus.append(case)
            if (i + 1) % 10_000 == 0:
                print(f"{i + 1} cases, {dict(counts)}, max {max_t * 1000:.0f} ms, {time.time() - t_start:.0f} s",
                      flush=True)
    elapsed = time.time() - t_start
    rss1 = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if not args.no_save:
        save_corpus(corpus)
    print(f"cases: {args.cases}  outcomes: {dict(counts)}  distinct outcomes: {len(sigs)}")
    print(f"max time per case: {max_t * 1000:.1f} ms ({max_case[0] if max_case else '-'})  total {elapsed:.0f} s")
    print(f"memory: rss {rss0 / MiB:.0f} -> {rss1 / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, cap {cap / MiB:.0f} MiB")
    for c in bad[:20]:
        print("BAD", json.dumps(c))
    _write_results(args, counts, per_seed, sigs, max_t, max_case, elapsed, rss0, rss1, peak, len(corpus), bad)
    return 1 if bad else 0


def _write_results(args: Any, counts: Counter[str], per_seed: Counter[str], sigs: Counter[str], max_t: float,
                   max_case: Any, elapsed: float, rss0: int, rss1: int, peak: int, n_corpus: int,
                   bad: list[dict[str, Any]]) -> None:
    lines = [
        "# GGUF header fuzzing",
        "",
        f"`python bench/fuzz_gguf.py --cases {args.cases} --seed {args.seed} --bound {args.bound}` "
        f"({time.strftime('%Y-%m-%d')}, 2-core VM, {elapsed:.0f} s).",
        "",
        "Each case: a seed file's header with 1-4 edits (60% aimed at counts, lengths, types, dims and offsets,",
        "the rest bit flips, byte sets, inserts, deletes, duplicated chunks, early EOF, truncated data), written",
        "with the seed's tensor data as a sparse hole, then `load_profile` + `make_plan` on two 4 GiB CPU cards.",
        f"Pass: a plan or a one-line ArcsplitError within {args.bound:.0f} s, under an address-space cap of "
        f"start + {args.memory_mib} MiB.",
        "",
        "| cases | plan | one-line error | crash | timeout | distinct outcomes | max time/case |",
        "|---|---|---|---|---|---|---|",
        f"| {args.cases:,} | {counts['plan']:,} | {counts['error']:,} | {counts['crash']:,} | {counts['timeout']:,} "
        f"| {len(sigs)} | {max_t * 1000:.1f} ms |",
        "",
        "Cases per seed: " + ", ".join(f"{k} {v:,}" for k, v in sorted(per_seed.items())) + ".",
        f"Slowest case: seed {max_case[0] if max_case else '-'} ({max_case[3] if max_case else ''}).",
        f"Memory: RSS {rss0 / MiB:.0f} MiB before, {rss1 / MiB:.0f} MiB after, peak {peak / MiB:.0f} MiB.",
        f"Corpus: {n_corpus} cases with distinct outcomes in tests/corpus/gguf/cases.json "
        "(replayed by tests/test_fuzz_gguf.py).",
        "",
        "Most common outcomes:",
        "",
    ]
    lines += [f"- {n:,} x `{s[:150]}`" for s, n in sigs.most_common(12)]
    found = [c for c in load_corpus() if c.get("note")]
    if found:
        lines += ["", "Bugs the fuzzer found in arcsplit/model.py's reader (fixed; these cases stay in the corpus):", ""]
        lines += sorted({f"- {c['note']}" for c in found})
    if bad:
        lines += ["", "Failures:", ""] + [f"- `{json.dumps(c)[:300]}`" for c in bad[:20]]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
