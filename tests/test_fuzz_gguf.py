"""Bad GGUF input: a mutated header ends, quickly, in a plan or a one-line ArcsplitError; never a crash, hang or
memory blow-up. The fast property test here runs a few thousand cases; bench/fuzz_gguf.py runs 100,000 and
keeps the cases with new outcomes in tests/corpus/gguf/, which test_corpus_replays replays."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fuzz_gguf as F  # noqa: E402

BOUND = 15.0  # seconds a case may take: guards a hang or a blow-up (most take < 1 s; a forged 2^24-item array took 6.6 s on a slow CI day)
CORPUS_CASES = F.load_corpus()


@pytest.fixture(scope="module")
def synth_seeds() -> dict[str, F.Seed]:
    """Fresh headers from today's arcsplit/synth.py (the corpus keeps its own copies for replay)."""
    return F.build_seeds(include_demo=False)


@pytest.fixture(scope="module")
def case_dir():
    with tempfile.TemporaryDirectory(prefix="arcsplit-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield Path(d)


_pos = st.integers(0, 1 << 30)
_ops = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 1 << 16), _pos,
              st.one_of(st.sampled_from(F.INTERESTING), st.integers(0, (1 << 64) - 1)),
              st.sampled_from(("set", "add", "sub", "mul"))),
    st.tuples(st.just("flip"), _pos, st.integers(0, 7)),
    st.tuples(st.just("byte"), _pos, st.integers(0, 255)),
    st.tuples(st.just("insert"), _pos, st.binary(min_size=1, max_size=16).map(bytes.hex)),
    st.tuples(st.just("delete"), _pos, st.integers(0, 63)),
    st.tuples(st.just("dup"), _pos, st.integers(0, 255)),
    st.tuples(st.just("eof"), _pos),
    st.tuples(st.just("shrink"), st.integers(1, 1 << 24)),
).map(list)


def _assert_clean(out: F.Outcome, what: object) -> None:
    assert out.kind in ("plan", "error"), f"{what}: {out.kind}: {out.detail}"
    assert out.seconds < BOUND, f"{what}: took {out.seconds:.1f} s"
    if out.kind == "error":
        assert "\n" not in out.detail and out.detail.split(": ", 1)[1].strip(), out.detail


@pytest.mark.slow  # thousands of generated cases
@settings(max_examples=2500, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(F.SYNTH_SEEDS), file=st.integers(0, 2), ops=st.lists(_ops, min_size=1, max_size=4))
def test_mutated_synthetic_headers(synth_seeds, case_dir, name, file, ops):
    _assert_clean(F.run_case(case_dir, synth_seeds[name], file, ops, BOUND), (name, file, ops))


@pytest.mark.slow  # thousands of generated cases
@settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(_ops, min_size=1, max_size=3))
def test_mutated_demo_header(demo_header, case_dir, ops):
    """The real 253 MB demo model's 6.5 MB header (262k-token vocabulary), as a sparse file."""
    _assert_clean(F.run_case(case_dir, demo_header, 0, ops, BOUND), ops)


@pytest.fixture(scope="module")
def demo_header(demo_model) -> F.Seed:
    return F.seed_from_paths("demo", Path(demo_model))


def test_unmutated_seeds_plan(synth_seeds, demo_header, case_dir):
    """The harness itself: every seed, untouched, goes all the way to a plan (so mutations reach the planner)."""
    for seed in [*synth_seeds.values(), demo_header]:
        out = F.run_case(case_dir, seed, 0, [])
        assert out.kind == "plan", (seed.name, out.detail)


# Every tenth case in the fast tier, all of them in the full suite (each takes tens of ms; 459 add up).
@pytest.mark.parametrize("case", [pytest.param(c, id=f"{i}-{c['seed']}", marks=() if i % 10 == 0 else pytest.mark.slow)
                                  for i, c in enumerate(CORPUS_CASES)])
def test_corpus_replays(case, case_dir, demo_model):
    """Every case the fuzzer kept still ends the way it did (a plan stays a plan, an error stays one line)."""
    seeds = _corpus_seeds(Path(demo_model))
    seed = seeds[case["seed"]]
    assert seed.sha256 == case["seed_sha256"], "the corpus seed changed; re-run bench/fuzz_gguf.py"
    out = F.run_case(case_dir, seed, case["file"], case["ops"], BOUND)
    _assert_clean(out, case["ops"])
    assert out.kind == case["outcome"], f"was {case['detail']}, now {out.detail}"


_SEEDS: dict[str, F.Seed] = {}


def _corpus_seeds(demo: Path) -> dict[str, F.Seed]:
    if not _SEEDS:
        _SEEDS.update(F.load_seeds(F.CORPUS / "seeds", demo))
    return _SEEDS


def test_corpus_is_there():
    assert len(CORPUS_CASES) >= 20, "run bench/fuzz_gguf.py to build tests/corpus/gguf"


# A forged count or length in a huge file must not make the reader allocate: run the reader under an address-space
# cap of its current size + 256 MiB on 8 GiB sparse files whose headers claim enormous strings and arrays.
_FORGE = textwrap.dedent("""
    import json, resource, struct, sys, time, psutil
    from arcsplit.errors import ArcsplitError
    from arcsplit.model import load_profile
    cap = psutil.Process().memory_info().vms + (256 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out = {}
    for path in sys.argv[1:]:
        t = time.perf_counter()
        try:
            load_profile(path, cache=False)
            out[path] = ["plan", time.perf_counter() - t]
        except ArcsplitError as exc:
            out[path] = ["error:" + str(exc), time.perf_counter() - t]
        except BaseException as exc:
            out[path] = ["crash:" + repr(exc), time.perf_counter() - t]
    print(json.dumps(out))
""")


def _kv_string(key: str, n: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, n)


def _kv_array(key: str, itype: int, n: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, itype, n)


FORGED = {
    "string value of 7 GiB": _kv_string("general.architecture", 7 << 30),
    "string value of 200 MiB": _kv_string("tokenizer.chat_template", 200 << 20),
    "string array of 2^40 items": _kv_array("tokenizer.ggml.tokens", 8, 1 << 40),
    "string array of 2^24 items": _kv_array("tokenizer.ggml.tokens", 8, 1 << 24),
    "u64 array of 2^28 items": _kv_array("tokenizer.ggml.scores", 10, 1 << 28),
    "u64 array of 2^60 items": _kv_array("tokenizer.ggml.scores", 10, 1 << 60),
    "nested arrays of 2^32 items": _kv_array("x", 9, 1 << 32),
    "key of 2^63 bytes": struct.pack("<Q", 1 << 63),
}


@pytest.mark.slow  # sparse multi-GB files, seconds each
@pytest.mark.parametrize("counts", [(1, 1), (1 << 40, 1), (1, 1 << 40)], ids=["kv", "n_kv", "n_tensors"])
def test_forged_counts_in_a_huge_file_stay_small(tmp_path, counts):
    paths = []
    for i, (name, body) in enumerate(FORGED.items()):
        n_tensors, n_kv = counts
        p = tmp_path / f"forged{i}.gguf"
        with open(p, "wb") as f:
            f.write(struct.pack("<IIQQ", 0x46554747, 3, n_tensors, n_kv) + body)
            f.truncate(8 << 30)  # an 8 GiB model, all hole
        paths.append(str(p))
    res = subprocess.run([sys.executable, "-c", _FORGE, *paths], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    for (name, _), p in zip(FORGED.items(), paths):
        verdict, seconds = out[p]
        assert verdict.startswith("error:"), f"{name}: {verdict}"
        assert "\n" not in verdict and seconds < BOUND, f"{name}: {verdict} in {seconds:.1f} s"
