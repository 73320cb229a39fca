"""arcsplit's own llama.cpp patches: they apply to the pinned tree, with `patch` or `git`, fail loudly on
another tree, key the build, and `arcsplit llama which` says which ones a build carries."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from arcsplit import serve as serve_group
from arcsplit.errors import BadInput, BuildError
from arcsplit.llama import build as build_mod
from arcsplit.llama import patches
from arcsplit.llama.build import BuildConfig
from arcsplit.llama.patches import rpc_patches_switched, rpc_shm_link
from arcsplit.proc.ports import free_port, wait_listening
from arcsplit.synth import write_llama
from arcsplit.llama.source import extract_source, fetch_sdist

from _rpc_client import build_set_reuse

RPC_FILE = "ggml/src/ggml-rpc/ggml-rpc.cpp"


def arcsplit(*args: str) -> subprocess.CompletedProcess[str]:
    # The managed build, not whatever $ARCSPLIT_LLAMA_DIR or a llama-server on the host's PATH points at.
    env = {k: v for k, v in os.environ.items() if k != "ARCSPLIT_LLAMA_DIR"}
    env["PATH"] = str(Path(sys.executable).parent)
    return subprocess.run([sys.executable, "-m", "arcsplit", *args], check=False, capture_output=True, text=True,
                          env=env, timeout=120)


def touched_files() -> list[str]:
    """Every file the patch set changes, read from the patches' ``+++ b/...`` lines."""
    found: list[str] = []
    for p in patches.patches():
        for line in p.text.decode().splitlines():
            if line.startswith("+++ b/"):
                name = line[len("+++ b/"):].split("\t")[0].strip()
                if name not in found:
                    found.append(name)
    return found


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    return fetch_sdist(tmp_path_factory.mktemp("fetch") / "fetch.log")


@pytest.fixture(scope="module")
def pristine(sdist, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """The pinned llama.cpp tree, freshly unpacked, and the stock bytes of every file the patches touch."""
    tree = extract_source(sdist, tmp_path_factory.mktemp("pinned") / "tree")
    assert patches.applied(tree) is None
    return tree, {name: (tree / name).read_bytes() for name in touched_files()}


def minimal_tree(root: Path, stock: dict[str, bytes]) -> Path:
    """A tree holding only the files the patches touch, as they are in the pinned source."""
    for name, data in stock.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_patch_set_is_not_empty_and_named_in_order():
    names = [p.name for p in patches.patches()]
    assert names and names == sorted(names)
    assert {"0001-rpc-async-uploads", "0002-rpc-one-segment-per-message"} <= set(names)
    assert all(p.summary for p in patches.patches())
    assert touched_files(), "a patch that touches no file"


@pytest.mark.slow  # extracts the pinned llama.cpp tree
def test_every_patch_applies_cleanly_to_the_pinned_tree(pristine, tmp_path):
    tree, stock = pristine
    log = tmp_path / "patch.log"
    patches.apply(tree, log)
    assert patches.applied(tree) == patches.digest()
    text = log.read_text()
    # Applies exactly: no hunk needed fuzz or an offset, none was rejected, no backup or reject files left.
    for word in ("fuzz", "offset", "FAILED", "reject", "Reversed"):
        assert word not in text, text
    assert not list(tree.rglob("*.rej")) and not list(tree.rglob("*.orig"))
    for name, data in stock.items():
        assert (tree / name).read_bytes() != data, f"{name} unchanged by the patches"
    assert "ARCSPLIT_RPC_STOCK" in (tree / RPC_FILE).read_text()
    # The marker names the patches, in order, after the digest.
    assert (tree / patches.MARKER).read_text().split() == [patches.digest(), *[p.name for p in patches.patches()]]

    # Applying again is a no-op: same marker, same files, nothing run.
    marker = (tree / patches.MARKER).read_bytes()
    patched = {name: (tree / name).read_bytes() for name in stock}
    log.write_text("")
    patches.apply(tree, log)
    assert log.read_text() == ""
    assert (tree / patches.MARKER).read_bytes() == marker
    assert {name: (tree / name).read_bytes() for name in stock} == patched


@pytest.mark.slow  # extracts the pinned llama.cpp tree
def test_git_apply_fallback_gives_the_same_bytes_as_patch(pristine, tmp_path, monkeypatch):
    _, stock = pristine
    with_patch = minimal_tree(tmp_path / "with-patch", stock)
    with_git = minimal_tree(tmp_path / "with-git", stock)
    patches.apply(with_patch, tmp_path / "patch.log")
    assert "patch -p1" in (tmp_path / "patch.log").read_text()

    real_which = shutil.which
    monkeypatch.setattr(patches.shutil, "which", lambda name, *a, **k: None if name == "patch" else real_which(name, *a, **k))
    patches.apply(with_git, tmp_path / "git.log")
    git_log = (tmp_path / "git.log").read_text()
    assert " apply -p1 " in git_log and "patch -p1" not in git_log, git_log

    assert patches.applied(with_git) == patches.applied(with_patch) == patches.digest()
    for name in stock:
        assert (with_git / name).read_bytes() == (with_patch / name).read_bytes(), name
    assert (with_git / patches.MARKER).read_bytes() == (with_patch / patches.MARKER).read_bytes()
    # Neither tool left anything beside the patched files.
    assert sorted(p.relative_to(with_git) for p in with_git.rglob("*")) == \
        sorted(p.relative_to(with_patch) for p in with_patch.rglob("*"))


@pytest.mark.slow  # extracts the pinned llama.cpp tree
def test_no_patch_tool_at_all_says_so(pristine, tmp_path, monkeypatch):
    _, stock = pristine
    tree = minimal_tree(tmp_path / "tree", stock)
    monkeypatch.setattr(patches.shutil, "which", lambda *a, **k: None)
    with pytest.raises(BuildError) as err:
        patches.apply(tree, tmp_path / "log")
    assert "--no-patches" in (err.value.fix or "")
    assert patches.applied(tree) is None


@pytest.mark.slow  # extracts the pinned llama.cpp tree
@pytest.mark.parametrize("tool", ["patch", "git"])
def test_a_tree_that_differs_is_an_error_naming_the_patch(pristine, tmp_path, monkeypatch, tool):
    _, stock = pristine
    # Another llama.cpp: the code around every hunk was rewritten, so no hunk's context matches.
    edited = {name: data.replace(b"ctx->dispatcher->send", b"ctx->dispatcher->post")
                        .replace(b"static void ", b"static inline void ")
              for name, data in stock.items()}
    assert edited != stock
    tree = minimal_tree(tmp_path / "tree", edited)
    if tool == "git":
        real_which = shutil.which
        monkeypatch.setattr(patches.shutil, "which",
                            lambda name, *a, **k: None if name == "patch" else real_which(name, *a, **k))
    log = tmp_path / "patch.log"
    with pytest.raises(BuildError) as err:
        patches.apply(tree, log)
    first = patches.patches()[0].name
    assert first in err.value.problem and str(log) in err.value.problem
    assert "--no-patches" in (err.value.fix or "")
    assert patches.applied(tree) is None and not (tree / patches.MARKER).exists()
    if tool == "git":  # git apply is all or nothing
        assert {name: (tree / name).read_bytes() for name in edited} == edited


@pytest.mark.slow  # extracts the pinned llama.cpp tree
@pytest.mark.parametrize("patch", patches.patches(), ids=lambda p: p.name)
def test_each_patch_applies_alone_to_the_pinned_tree(pristine, tmp_path, patch):
    """Every patch is one upstream-shaped change: it applies on the pinned tree without any other patch (line
    offsets allowed, no fuzz, no rejected hunk), and it answers to the same switch, ARCSPLIT_RPC_STOCK."""
    tool = shutil.which("patch")
    if tool is None:
        pytest.skip("`patch` is not installed (the set itself is checked with git apply above)")
    _, stock = pristine
    tree = minimal_tree(tmp_path / "tree", stock)
    before = {name: (tree / name).read_bytes() for name in stock}
    run = subprocess.run([tool, "-p1", "--forward", "--batch", "--dry-run", "-d", str(tree), "-i", str(patch.path)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    for word in ("fuzz", "FAILED", "reject", "Reversed"):
        assert word not in run.stdout, run.stdout
    assert {name: (tree / name).read_bytes() for name in stock} == before  # a dry run changes nothing
    added = "\n".join(line for line in patch.text.decode().splitlines() if line.startswith("+"))
    assert "ARCSPLIT_RPC_STOCK" in added, f"{patch.name} has no off switch of its own"


@pytest.mark.slow  # extracts the pinned llama.cpp tree
def test_a_tree_already_patched_without_marker_is_an_error(pristine, tmp_path):
    """`patch --forward` refuses to apply twice; a half-known tree is never marked as carrying the set."""
    _, stock = pristine
    tree = minimal_tree(tmp_path / "tree", stock)
    patches.apply(tree, tmp_path / "log")
    (tree / patches.MARKER).unlink()
    with pytest.raises(BuildError):
        patches.apply(tree, tmp_path / "log")
    assert patches.applied(tree) is None


def test_build_key_carries_the_patch_set(monkeypatch):
    patched, stock = BuildConfig("cpu").key, BuildConfig("cpu", patched=False).key
    assert patched != stock
    assert BuildConfig("cpu").build_dir != BuildConfig("cpu", patched=False).build_dir
    assert patched == BuildConfig("cpu").key  # stable
    assert patched.startswith("cpu-") and stock.startswith("cpu-")
    # Another patch set is another build; the stock build does not depend on the patches at all.
    monkeypatch.setattr(patches, "digest", lambda: "0123456789")
    assert BuildConfig("cpu").key != patched
    assert BuildConfig("cpu", patched=False).key == stock


@pytest.mark.slow  # extracts the pinned llama.cpp tree
def test_managed_trees_patched_and_stock_are_apart(sdist, tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / "build.log"
    steps: list[str] = []
    progress = lambda step, pct: steps.append(step)

    stock = build_mod._managed_tree(sdist, False, log, progress)
    src = build_mod._managed_tree(sdist, True, log, progress)
    assert stock != src and stock.name == "src-stock" and src.name == "src"
    assert patches.applied(stock) is None
    assert "ARCSPLIT_RPC_STOCK" not in (stock / RPC_FILE).read_text()
    assert patches.applied(src) == patches.digest()
    assert "ARCSPLIT_RPC_STOCK" in (src / RPC_FILE).read_text()
    assert steps == ["patch"]

    # A tree carrying this patch set is reused as it is ...
    (src / "sentinel").write_text("kept")
    assert build_mod._managed_tree(sdist, True, log, progress) == src
    assert (src / "sentinel").exists() and steps == ["patch"]
    # ... one marked with another set is unpacked again and patched with this one.
    (src / patches.MARKER).write_text("0123456789\n0001-old\n")
    assert build_mod._managed_tree(sdist, True, log, progress) == src
    assert not (src / "sentinel").exists()
    assert patches.applied(src) == patches.digest() and steps == ["patch", "patch"]


def test_build_patches_reads_the_bin_dir_marker(tmp_path):
    assert patches.build_patches(tmp_path) is None
    (tmp_path / patches.MARKER).write_text("stock\n")
    assert patches.build_patches(tmp_path) == []
    (tmp_path / patches.MARKER).write_text("0123456789\n0001-a\n0002-b\n")
    assert patches.build_patches(tmp_path) == ["0001-a", "0002-b"]


@pytest.fixture(scope="module")
def managed_cpu_build() -> Path:
    config = BuildConfig("cpu")
    build_mod.build(config)  # a no-op when scripts/test already built it
    return config.bin_dir


@pytest.mark.slow  # starts llama.cpp
def test_which_reports_the_patches_of_the_managed_build(managed_cpu_build):
    r = arcsplit("llama", "which", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert Path(data["bin_dir"]) == managed_cpu_build, data
    assert data["patches"] == [p.name for p in patches.patches()]
    assert data["patches"][:2] == ["0001-rpc-async-uploads", "0002-rpc-one-segment-per-message"]
    assert (managed_cpu_build / patches.MARKER).read_text().split()[0] == patches.digest()

    text = arcsplit("llama", "which")
    assert text.returncode == 0, text.stderr
    assert "arcsplit patches " + ", ".join(data["patches"]) in text.stdout


@pytest.mark.slow  # starts llama.cpp
def test_which_on_a_bin_dir_without_marker_says_unknown(managed_cpu_build, tmp_path):
    # The same binaries, seen from a dir arcsplit did not build: the patches are unknown (null), not [].
    for f in managed_cpu_build.iterdir():
        if f.name != patches.MARKER:
            (tmp_path / f.name).symlink_to(f)
    r = arcsplit("llama", "which", "--json", "--llama-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["patches"] is None
    (tmp_path / patches.MARKER).write_text("stock\n")
    r = arcsplit("llama", "which", "--llama-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "arcsplit patches none" in r.stdout


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_build_help_offers_no_patches():
    r = arcsplit("llama", "build", "--help")
    assert r.returncode == 0, r.stderr
    assert "--no-patches" in r.stdout


def test_missing_note_names_the_fix_only_when_the_build_lacks_the_patches(tmp_path):
    current = tmp_path / "current"
    current.mkdir()
    (current / patches.MARKER).write_text(patches.digest() + "\n" + "\n".join(p.name for p in patches.patches()))
    assert patches.missing_note(current) is None
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / patches.MARKER).write_text("stock\n")
    older = tmp_path / "older"
    older.mkdir()
    (older / patches.MARKER).write_text("0123456789\n0001-rpc-async-uploads\n")
    for d, what in ((stock, "stock or unknown"), (tmp_path, "stock or unknown"), (older, "older arcsplit patch set")):
        note = patches.missing_note(d)
        assert note and what in note and "arcsplit llama build" in note and "\n" not in note


@pytest.mark.slow  # a Python process: over a second on a busy machine
def test_bad_source_is_refused_even_when_a_build_exists(llama_bins, tmp_path):
    """A finished build for the key must not hide a wrong --source: one line, exit 2."""
    r = subprocess.run([sys.executable, "-m", "arcsplit", "llama", "build", "--source", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not a llama.cpp source tree" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


ACTIVATION = re.compile(r"\[set_tensor\] .*size: (\d+)")
COMPUTE = re.compile(r"\[graph_(re)?compute\]")


def first_upload_per_compute(log: str) -> list[int]:
    """Per graph the rpc-server computed: the size of the first SET_TENSOR it received since the previous one."""
    firsts: list[int] = []
    first = None
    for line in log.splitlines():
        if m := ACTIVATION.search(line):
            first = int(m.group(1)) if first is None else first
        elif COMPUTE.search(line) and first is not None:
            firsts.append(first)
            first = None
    return firsts


@pytest.mark.slow
@pytest.mark.parametrize("stock", [False, True], ids=["patched", "stock"])
def test_inputs_first_only_on_an_rpc_device_fed_by_a_local_backend(llama_bins, tmp_path, monkeypatch, stock):
    """Patch 0004's gate, read off the wire (GGML_RPC_DEBUG logs every SET_TENSOR an rpc-server receives): in an
    all-RPC group the first server, fed by llama-server's own CPU (the token embeddings), gets the user inputs
    before the activation; the second, fed by the first rpc-server, gets llama.cpp's order (activation first),
    which measured faster between two RPC servers. ARCSPLIT_RPC_STOCK=1 keeps llama.cpp's order everywhere.
    A small llama (small vocabulary), so that both rpc-servers hold layers and both get user inputs."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512)
    activation = 256 * 4  # one decoded token's hidden state, F32
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    with rpc_patches_switched(on=not stock), \
            serve_group(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=1024, parallel=1, threads=1,
                        port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir)) as server:
        r = httpx.post(f"{server.url}/completion", json={"prompt": "Once upon a time", "n_predict": 6,
                                                          "temperature": 0, "ignore_eos": True}, timeout=300)
        r.raise_for_status()
        run_dir = Path(server.status()["run_dir"])
    # read once the group has stopped: a loaded machine may not have written the last steps' lines while it runs
    logs = {name: (run_dir / f"{name}.log").read_text(errors="replace") for name in ("rpc0", "rpc1")}
    firsts = {name: first_upload_per_compute(log)[-4:] for name, log in logs.items()}
    assert all(len(v) == 4 for v in firsts.values()), firsts  # the last decode steps of each server
    # both hold layers: each receives the activation and user inputs (positions: 4 bytes) every token
    assert all("size: 4\n" in log and f"size: {activation}\n" in log for log in logs.values())
    # rpc1 is fed by rpc0 (an RPC device): llama.cpp's order, the activation first, patched or not
    assert firsts["rpc1"] == [activation] * 4, firsts
    if stock:
        assert firsts["rpc0"] == [activation] * 4, firsts
    else:  # rpc0 is fed by llama-server's CPU: the user inputs (positions, masks, KV indices) go first
        assert all(size != activation for size in firsts["rpc0"]), firsts


MODEL_BUFFER = re.compile(r"(RPC\d+\[[^\]]+\]|CPU_Mapped|CPU) model buffer size = +([\d.]+) MiB")


@pytest.mark.slow
def test_an_all_rpc_group_holds_the_token_embeddings_on_its_first_card(llama_bins, tmp_path, monkeypatch):
    """Patch 0015 through arcsplit, asked for on one machine (the user's ARCSPLIT_INPUT_ON_CARD=1; auto does it where
    the first card is on another host): an all-RPC group plans the token embeddings on its first card and tells
    llama-server so, which loads them there, where the plan said (the first rpc-server's
    model buffer grows by them; the plan does not under-predict it); the first rpc-server then gets each token's id,
    never its embedding row (GGML_RPC_DEBUG logs every SET_TENSOR), and the greedy tokens are the same as with
    the user's ARCSPLIT_INPUT_ON_CARD=0, which keeps them on llama-server's CPU as llama.cpp does."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=8, n_embd=320, n_head=4, n_head_kv=2, n_ff=512,
                        n_vocab=8192)
    row = 320 * 4  # one token's embedding, F32 (a size no mask or index set has here)
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    seen = {}
    for on in ("1", "0"):
        monkeypatch.setenv(patches.INPUT_ON_CARD_ENV, on)
        with serve_group(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=1024, parallel=1, threads=1,
                         port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir)) as server:
            plan, run_dir = server.plan, Path(server.status()["run_dir"])
            time.sleep(1)  # the load's lines (its small weights' sets among them) are in the log before the mark
            mark = len((run_dir / "rpc0.log").read_text(errors="replace"))
            r = httpx.post(f"{server.url}/completion", json={
                "prompt": "Once upon a time, in a land far away", "n_predict": 6, "temperature": 0,
                "ignore_eos": True, "return_tokens": True}, timeout=300)
            r.raise_for_status()
        logs = {name: (run_dir / f"{name}.log").read_text(errors="replace") for name in ("server", "rpc0")}
        buffers = {m.group(1): float(m.group(2)) for m in MODEL_BUFFER.finditer(logs["server"])}
        dialled = re.search(r"--rpc ([^,\s]+)", logs["server"])
        assert dialled, logs["server"][:2000]
        first = f"RPC0[{dialled.group(1)}]"  # the first --rpc endpoint's card
        sizes = [int(m.group(3)) for m in SET_AT.finditer(logs["rpc0"][mark:])]  # the request's sets
        seen[on] = (r.json()["tokens"], plan, logs["server"], buffers[first], sizes)
    (tok_on, plan_on, log_on, rpc0_on, sets_on), (tok_off, plan_off, log_off, rpc0_off, sets_off) = seen["1"], seen["0"]
    assert tok_on == tok_off and len(tok_on) == 6
    assert plan_on.options.input_on_first and not plan_off.options.input_on_first
    assert "input layer on RPC0 (ARCSPLIT_INPUT_ON_CARD)" in log_on and "ARCSPLIT_INPUT_ON_CARD" not in log_off
    assert plan_off.host_bytes - plan_on.host_bytes == 8192 * 320 * 2  # the F16 embeddings left the host
    for plan, loaded in ((plan_on, rpc0_on), (plan_off, rpc0_off)):  # the plan holds what llama.cpp loaded there
        assert loaded - 0.01 <= plan.cards[0].weights / 2**20 <= loaded + 0.06
    assert row not in sets_on and 4 in sets_on  # each decoded token's id, never its embedding row
    assert sets_off.count(row) >= 5  # stock: the CPU's lookup, a row a decoded token


def all_rpc_second_server_log(model: Path, llama_bins, n_predict: int) -> tuple[list[int], str]:
    """Serve ``model`` all-RPC on two CPU cards through arcsplit, take one greedy completion, stop: its tokens and
    the second rpc-server's log (with GGML_RPC_DEBUG=1 in the environment, every command it received)."""
    with serve_group(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=1024, parallel=1, threads=1,
                     port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir)) as server:
        r = httpx.post(f"{server.url}/completion", json={
            "prompt": "Once upon a time, in a land far away, there lived a keeper of lighthouses",
            "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "return_tokens": True}, timeout=300)
        r.raise_for_status()
        run_dir = Path(server.status()["run_dir"])
    return r.json()["tokens"], (run_dir / "rpc1.log").read_text(errors="replace")


SET_AT = re.compile(r"\[set_tensor\] buffer: \S+, data: (\S+), offset: (\d+), size: (\d+)")


@pytest.mark.slow
def test_an_activation_between_two_rpc_servers_is_relayed_in_chunks(llama_bins, tmp_path, monkeypatch):
    """Patch 0007, read off the wire: in an all-RPC group the prompt's activation reaches the second rpc-server
    as SET_TENSORs of at most ARCSPLIT_RPC_RELAY_KIB at rising offsets of one tensor (read from the first in the
    same chunks), not as one SET of the whole; 0 turns it off (one SET at offset 0, stock's path). With 0001's
    queued sends the chunks' reads are not waited for by llama-server (ARCSPLIT_RPC_ASYNC_READ, on by default);
    waited for, the wire is the same. The greedy tokens are the same every way."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512)
    row = 256 * 4  # one token's hidden state, F32
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    seen = {}
    for kib, queued in (("4", "1"), ("4", "0"), ("0", "1")):
        monkeypatch.setenv("ARCSPLIT_RPC_RELAY_KIB", kib)
        monkeypatch.setenv("ARCSPLIT_RPC_ASYNC_READ", queued)
        tokens, log = all_rpc_second_server_log(model, llama_bins, n_predict=4)
        sets = [(m.group(1), int(m.group(2)), int(m.group(3))) for m in SET_AT.finditer(log)]
        seen[kib, queued] = (tokens, sets)
    tokens_off, sets_off = seen["0", "1"]
    assert len(tokens_off) == 4
    for queued in ("1", "0"):
        tokens_on, sets_on = seen["4", queued]
        assert tokens_on == tokens_off, queued
        chunks = [(d, off, n) for d, off, n in sets_on if off > 0]
        assert chunks, "no SET_TENSOR at an offset: the activation crossed whole"
        assert all(n <= 4096 and off % 4096 == 0 for _, off, n in chunks)
        # one tensor's chunks follow each other: offsets 0, 4096, ... ending on whole rows (the prompt's tokens)
        data = chunks[0][0]
        run = [(off, n) for d, off, n in sets_on if d == data]
        first = run[:next(i for i, (off, _) in enumerate(run[1:], 1) if off == 0)] if sum(o == 0 for o, _ in run) > 1 \
            else run
        assert [off for off, _ in first] == [i * 4096 for i in range(len(first))] and len(first) >= 2, queued
        assert sum(n for _, n in first) % row == 0
    assert not [s for s in sets_off if s[1] > 0], "ARCSPLIT_RPC_RELAY_KIB=0 still sent chunks"


# the rpc-server's own debug lines (GGML_RPC_DEBUG=1) for a gate, a repeated graph and a gated set's data
GATED = re.compile(r"^\[(gate|graph_recompute|set_tensor_gated)\] (?:data: (0x[0-9a-f]+)|device: \d+$)", re.M)


@pytest.mark.slow
def test_an_activation_for_an_rpc_server_is_announced_before_its_data(llama_bins, tmp_path, monkeypatch):
    """Gated sets (patches 0001, 0003, 0007), read off the wire in an all-RPC group: with ARCSPLIT_RPC_GATE=1 each
    decoded token's activation reaches the second rpc-server as GATE (its destination), then the graph that reads
    it (GRAPH_RECOMPUTE), then the data (SET_TENSOR_GATED) for that same destination. A CPU device cannot wait on a
    host word, so that server computes the graph once the data has come: the greedy tokens are the same as with
    gated sets off (the default), where no GATE is sent at all."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512)
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    seen = {}
    for gate in ("1", "0"):
        monkeypatch.setenv("ARCSPLIT_RPC_GATE", gate)
        tokens, log = all_rpc_second_server_log(model, llama_bins, n_predict=6)
        seen[gate] = (tokens, [(m.group(1), m.group(2)) for m in GATED.finditer(log)], log)
    tokens_on, events_on, log_on = seen["1"]
    tokens_off, events_off, _ = seen["0"]
    assert len(tokens_on) == 6 and tokens_on == tokens_off
    assert not [e for e in events_off if e[0] != "graph_recompute"], "a GATE went out with ARCSPLIT_RPC_GATE=0"
    # gate -> graph -> its data, for the same destination (the graph's other inputs, plain SET_TENSORs, may come
    # between the gate and the graph): the decoded tokens' steady state
    names = [e[0] for e in events_on]
    windows = [i for i in range(len(names) - 2) if names[i:i + 3] == ["gate", "graph_recompute", "set_tensor_gated"]]
    assert len(windows) >= 3, names
    assert all(events_on[i][1] == events_on[i + 2][1] for i in windows)
    assert "computed when its gated sets' data comes" in log_on
    assert "before the data of a gated set" not in log_on


# ggml-rpc's commands (ggml-rpc.cpp's enum rpc_cmd; GATE and SET_TENSOR_GATED are patch 0003's)
ALLOC_BUFFER, BUFFER_GET_BASE, SET_TENSOR, GET_TENSOR, GRAPH_COMPUTE, HELLO, GRAPH_RECOMPUTE, GATE, SET_TENSOR_GATED = \
    0, 3, 6, 8, 10, 14, 16, 18, 19
GGML_TENSOR_FLAG_COMPUTE = 16  # ggml.h: a graph node the backend must compute
GGML_OP_ADD = 2  # ggml.h's enum ggml_op


class RawRpc:
    """A client of ggml RPC at the byte level: | cmd (1 byte) | size (8 bytes LE) | payload |, each reply | size |
    payload |. For what llama-server never sends: a server's rules are checked by breaking them on purpose."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.padding = self.call(HELLO, bytes(24), 28)[3]  # major, minor, patch, padding, transport caps

    def call(self, cmd: int, payload: bytes, reply: int | None = None) -> bytes:
        """Send one message; `reply` bytes back, or b"" where the server closed the connection instead."""
        self.s.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
        if reply is None:
            return b""
        data = b""
        while len(data) < 8 + reply:
            chunk = self.s.recv(65536)
            if not chunk:
                return b""
            data += chunk
        return data[8:]

    def closed(self) -> bool:
        """Whether the server has closed this connection (it answers nothing to what follows)."""
        try:
            return self.s.recv(1) == b""
        except OSError:
            return True

    def f32_tensor(self, n: int, tid: int = 1, op: int = 0, srcs: tuple[int, ...] = ()) -> bytes:
        """A fresh buffer of n F32 values on device 0 and an rpc_tensor (packed, 296 bytes) over all of it, with id
        ``tid``; a graph node where ``op`` is not 0 (ggml.h's enum ggml_op), computed from the tensors of ids
        ``srcs``."""
        remote, _ = struct.unpack("<QQ", self.call(ALLOC_BUFFER, struct.pack("<IQ", 0, 4 * n), 16))
        (base,) = struct.unpack("<Q", self.call(BUFFER_GET_BASE, struct.pack("<Q", remote), 8))
        flags = GGML_TENSOR_FLAG_COMPUTE if op else 0
        src = [*srcs, *[0] * (10 - len(srcs))]
        return struct.pack("<QIQ4I4II16ii10QQQQ64si", tid, 0, remote, n, 1, 1, 1, 4, 4 * n, 4 * n, 4 * n, op,
                           *([0] * 16), flags, *src, 0, 0, base, b"x", 0)

    def close(self) -> None:
        self.s.close()


def sum_graph(c: RawRpc, a: bytes, n: int) -> bytes:
    """A one-node graph b = a + a over ``a`` (n F32s, id 1) computed once on device 0, so it can be repeated
    (GRAPH_RECOMPUTE); b's rpc_tensor."""
    b = c.f32_tensor(n, 2, GGML_OP_ADD, (1, 1))
    c.call(GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 2, 2) + a + b)  # device, 1 node (id 2), 2 tensors
    return b


@contextlib.contextmanager
def rpc_server_proc(llama_bins, log: Path, **env: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """The managed build's rpc-server on a free loopback port, its output in `log`: the process and its port, once it
    listens."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([str(llama_bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_listening(proc, "127.0.0.1", port, timeout=10)
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def rpc_server_on(llama_bins, log: Path, **env: str) -> Iterator[int]:
    """rpc_server_proc's port alone."""
    with rpc_server_proc(llama_bins, log, **env) as (_, port):
        yield port


@pytest.mark.slow  # a real rpc-server of the managed build
def test_an_rpc_server_offers_gated_sets_and_refuses_data_without_a_gate(llama_bins, tmp_path):
    """The rpc-server's side of gated sets, over a raw socket: its HELLO reply offers them (the padding byte, 0 from
    a stock server: bit 1 gated sets, bit 2 a new graph built ahead of their data) unless ARCSPLIT_RPC_ASYNC_READ=0;
    gated data that no GATE announced closes that connection with one line in the server's log, and the server goes
    on serving the next client."""
    for async_read, offered in (("1", 3), ("0", 0)):
        log = tmp_path / f"rpc-{async_read}.log"
        with rpc_server_on(llama_bins, log, ARCSPLIT_RPC_ASYNC_READ=async_read) as port:
            c = RawRpc(port)
            assert c.padding == offered
            if offered:
                c.call(SET_TENSOR_GATED, bytes(200))  # a header's worth of bytes, no GATE before it
                assert c.closed()
                assert "gated data without a gate" in log.read_text()
                assert RawRpc(port).padding & 1, "the rpc-server stopped serving after one bad client"
            c.close()


def gated_sets_hold_their_rules(port: int, log: Path, device_waits: bool) -> None:
    """Over raw sockets to the rpc-server on ``port`` (its output in ``log``, GGML_RPC_DEBUG=1 where
    ``device_waits``): gated data reads back as set. Each way of breaking an open gate closes only that connection,
    with its own line in the server's log, and the next client is served within RawRpc's 10 s: another command
    before the data, data that does not match the gate, a SET_TENSOR into the gate's region, a client gone before
    its data, a second graph before the data (a one-node graph, b = a + a, repeated twice). ``device_waits``: every
    gate took the device-side path (a queued wait the server must release)."""
    data = bytes(range(256)) * 4  # 256 F32s' worth
    c = RawRpc(port)
    t = c.f32_tensor(256)
    c.call(GATE, t + struct.pack("<QQ", 0, len(data)))
    c.call(SET_TENSOR_GATED, t + b"\0" + struct.pack("<Q", 0) + data)
    assert c.call(GET_TENSOR, t + struct.pack("<QQ", 0, len(data)), len(data)) == data
    c.close()
    breaks = [  # (its log line, the breach, whether it needs a stored graph to repeat: sum_graph)
        ("Command 8 before the data of a gated set",
         lambda c, t: c.call(GET_TENSOR, t + struct.pack("<QQ", 0, 16)), False),
        ("gated data does not match its gate",
         lambda c, t: c.call(SET_TENSOR_GATED, t + b"\0" + struct.pack("<Q", 4) + data[4:]), False),
        ("A SET_TENSOR into an open gate's region",
         lambda c, t: c.call(SET_TENSOR, t + b"\0" + struct.pack("<Q", 512) + data[:64]), False),
        ("Client connection closed", lambda c, t: c.s.close(), False),
        ("A second graph before the data of a gated set",
         lambda c, t: [c.call(GRAPH_RECOMPUTE, struct.pack("<I", 0)) for _ in range(2)], True),
    ]
    for n, (line, breach, graph) in enumerate(breaks, start=2):
        before = log.read_text().count(line)
        c = RawRpc(port)
        t = c.f32_tensor(256)
        if graph:
            sum_graph(c, t, 256)
        c.call(GATE, t + struct.pack("<QQ", 0, len(data)))
        breach(c, t)
        assert c.closed(), line
        c.close()
        assert RawRpc(port).padding & 1, f"the rpc-server stopped serving after: {line}"
        text = log.read_text()
        assert text.count(line) > before, line
        assert text.count("device wait: yes") == (n if device_waits else 0), line


@pytest.mark.slow  # a real rpc-server of the managed build
def test_an_rpc_server_sets_gated_data_and_closes_a_connection_that_breaks_a_gate(llama_bins, tmp_path):
    """On a device that cannot wait on a host word (CPU) the rpc-server sets gated data when it comes: read back, it
    is the data. Each way of breaking an open gate closes only that connection, with its own line in the server's
    log, and the server goes on serving (gated_sets_hold_their_rules)."""
    log = tmp_path / "rpc.log"
    with rpc_server_on(llama_bins, log, GGML_RPC_DEBUG="1") as port:
        gated_sets_hold_their_rules(port, log, device_waits=False)


def rings_left() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("arcsplit-rpc-*")} if Path("/dev/shm").is_dir() else set()


@pytest.mark.slow
def test_llama_server_and_the_rpc_servers_of_one_host_link_through_shared_memory(llama_bins, tmp_path):
    """Patch 0008 through arcsplit: an all-RPC group on one host links llama-server to each rpc-server through
    shared memory (each rpc-server's log says so), with the weights loaded over the rings (an 8 MiB output
    matrix: bigger than a ring, so it streams and wraps) and the same greedy tokens as over loopback TCP
    (ARCSPLIT_RPC_SHM=0, no such line). No ring's name stays in /dev/shm while the group serves or after."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                        n_vocab=8192, dtype="f32")
    before = rings_left()
    seen = {}
    for on in (True, False):
        with rpc_shm_link(on), serve_group(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=1024,
                                           parallel=1, threads=1, port=free_port(), bus=False, rpc_seed=False,
                                           rpc_cache=False, llama_dir=str(llama_bins.bin_dir)) as server:
            r = httpx.post(f"{server.url}/completion", json={
                "prompt": "Once upon a time, in a land far away, there lived a keeper of lighthouses",
                "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}, timeout=300)
            r.raise_for_status()
            serving = rings_left() - before
            run_dir = Path(server.status()["run_dir"])
        logs = [(run_dir / f"rpc{i}.log").read_text(errors="replace") for i in (0, 1)]
        seen[on] = (r.json()["tokens"], logs, serving)
    (tokens_on, logs_on, serving_on), (tokens_off, logs_off, _) = seen[True], seen[False]
    assert tokens_on == tokens_off and len(tokens_on) == 8
    assert all("shared-memory link" in log for log in logs_on), [log[-400:] for log in logs_on]
    assert not any("shared-memory link" in log for log in logs_off)
    assert serving_on == set() and rings_left() - before == set()


_FULL_SHM_CHILD = """
import json, sys
from pathlib import Path
import httpx
from arcsplit import serve
from arcsplit.proc.ports import free_port, wait_listening
model, llama_dir = sys.argv[1:3]
with serve(model, gpus=[0, 1], backend="cpu", mode="rpc", ctx=1024, parallel=1, threads=1, port=free_port(),
           bus=False, rpc_seed=False, rpc_cache=False, llama_dir=llama_dir) as server:
    r = httpx.post(f"{server.url}/completion", json={"prompt": "The lighthouse keeper", "n_predict": 4,
                   "temperature": 0, "ignore_eos": True, "return_tokens": True}, timeout=300)
    r.raise_for_status()
    status = server.status()
    run_dir = Path(status["run_dir"])
logs = {p.stem: p.read_text(errors="replace") for p in run_dir.glob("*.log")}
left = sorted(p.name for p in Path("/dev/shm").iterdir())
print(json.dumps({"tokens": r.json()["tokens"], "logs": logs, "left": left, "notes": status["notes"]}))
"""


@pytest.mark.slow
def test_a_full_dev_shm_leaves_the_link_on_tcp_and_says_why(llama_bins, tmp_path):
    """A container's /dev/shm is small (64 MiB by Docker's default) and shared with other programs. When
    llama-server cannot reserve a link's 8 MiB there, patch 0008 keeps that link on TCP: the group serves, each
    connection's warning names the cause, arcsplit's status carries it as a note with the fix (serve prints it),
    and nothing is left in /dev/shm. Here the group runs in a private mount
    namespace whose /dev/shm is a 1 MiB tmpfs (the machine's own /dev/shm is not touched)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a private /dev/shm needs root and unshare (CI runs as root)")
    model = write_llama(tmp_path / "llama.gguf", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                        n_vocab=512, dtype="f32")
    child = tmp_path / "child.py"
    child.write_text(_FULL_SHM_CHILD)
    env = {k: v for k, v in os.environ.items() if k != "ARCSPLIT_RPC_SHM"}  # arcsplit's default: the link on
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        'mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm && exec "$0" "$@"',
                        sys.executable, str(child), str(model), str(llama_bins.bin_dir)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 4
    assert "no shared-memory link (/dev/shm: No space left on device); TCP only" in out["logs"]["server"]
    assert not any("RPC: shared-memory link" in log for log in out["logs"].values())
    assert out["left"] == []
    assert len(out["notes"]) == 1 and "loopback TCP" in out["notes"][0] and "No space left on device" in out["notes"][0]
    assert "--shm-size" in out["notes"][0]


def _same_probs(a: list, b: list, tol: float = 2e-3) -> bool:
    """Two greedy runs' tokens with their top-N candidates: the same ids, and log-probabilities within ``tol``. A
    wrong byte in the restored KV moves them by far more; on a loaded machine the parallel streams may be batched
    differently, which places the cells in another order and moves the last digits of attention's sums."""
    def ids(t: dict) -> tuple:
        return t["id"], frozenset(c["id"] for c in t.get("top_logprobs", ()))

    def probs(t: dict) -> dict:
        return {c["id"]: c["logprob"] for c in (t, *t.get("top_logprobs", ()))}

    return len(a) == len(b) and all(
        ids(x) == ids(y) and all(abs(p - probs(y)[k]) <= tol for k, p in probs(x).items())
        for x, y in zip(a, b))


def _restore_after_streams(model: Path, llama_bins, fa: str) -> tuple[list, int, str]:
    """All-RPC on two CPU cards (-np 4, unified KV, llama.cpp's host prompt cache): a prompt, 4 parallel streams
    (they take every slot, so the prompt's KV goes to the prompt cache, and interleave their cells), then the prompt
    again with cache_prompt true, which llama-server restores from its cache into the scattered KV. Its tokens with
    their top-4 probabilities (which move with any byte of the restored KV, where a random model's argmax may not),
    the cached tokens it reused, and the second rpc-server's log (GGML_RPC_DEBUG=1)."""
    prompt = "Once upon a time, in a land far away, there lived a keeper of lighthouses " * 6
    with serve_group(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=2048, parallel=4, threads=1,
                     port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir), extra_args=("-fa", fa)) as server:
        def post(body: dict) -> dict:
            r = httpx.post(f"{server.url}/completion", json={"temperature": 0, "ignore_eos": True, **body}, timeout=300)
            r.raise_for_status()
            return r.json()

        post({"prompt": prompt, "n_predict": 1, "cache_prompt": False})
        # one request of four prompts: four slots at once, batched the same way every time (threads would not be)
        post({"prompt": [f"Stream {k} tells a story about the sea" for k in range(4)], "n_predict": 24})
        got = post({"prompt": prompt, "n_predict": 8, "cache_prompt": True, "n_probs": 4})
        run_dir = Path(server.status()["run_dir"])
    return (got["completion_probabilities"], int(got["timings"]["cache_n"]),
            (run_dir / "rpc1.log").read_text(errors="replace"))


@pytest.mark.slow
@pytest.mark.parametrize("fa", ["on", "off"])  # off: V is transposed, one piece per row and run of cells
def test_a_prompt_restored_after_parallel_streams_moves_in_spans(llama_bins, tmp_path, monkeypatch, fa):
    """Patch 0010: the prompt cache's save and restore of a sequence whose cells parallel streams scattered reach
    an rpc-server as far fewer SET_TENSOR and GET_TENSOR commands than one per run of cells (ARCSPLIT_KV_GAP_KIB=0,
    llama.cpp's way), and the tokens decoded on the restored KV are the same: the spans carry the same bytes, the
    cells between the pieces (other sequences') keep theirs."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512)
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    seen = {}
    for gap in ("0", "64"):
        monkeypatch.setenv("ARCSPLIT_KV_GAP_KIB", gap)
        tokens, cached, log = _restore_after_streams(model, llama_bins, fa)
        seen[gap] = tokens, cached, log.count("[set_tensor]"), log.count("[get_tensor]")
    (tokens_off, cached_off, sets_off, gets_off), (tokens_on, cached_on, sets_on, gets_on) = seen["0"], seen["64"]
    assert len(tokens_on) == 8 and _same_probs(tokens_on, tokens_off)  # ids, top-4 candidates and their probabilities
    assert cached_on > 100 and cached_on == cached_off, "the prompt was not restored from the prompt cache"
    assert gets_on < gets_off and sets_on <= sets_off
    assert (sets_off + gets_off) - (sets_on + gets_on) > 100, seen


def _unused_load(model: Path, llama_bins) -> tuple[int, list[int], int]:
    """All-RPC on two CPU cards (-np 4, unified KV, llama.cpp's host prompt cache): a prompt P with the cache on, 4
    parallel streams (they take every slot, so P's KV goes to the prompt cache), a request Q with cache_prompt false
    whose first 40 % is P's, then P again with the cache on. Returns P's reused tokens (cache_n) at the end, Q's
    tokens, and the count of P's tokens."""
    words = [f"w{i}" for i in range(120)]
    p_text = "The keeper wrote " + " ".join(words)
    q_text = "The keeper wrote " + " ".join(words[:44]) + " " + " ".join(f"z{i}" for i in range(90))
    with serve_group(str(model), gpus=[0, 1], backend="cpu", mode="rpc", ctx=2048, parallel=4, threads=1,
                     port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir)) as server:
        def post(body: dict) -> dict:
            r = httpx.post(f"{server.url}/completion", json={"temperature": 0, "ignore_eos": True, **body}, timeout=300)
            r.raise_for_status()
            return r.json()

        n_p = len(httpx.post(f"{server.url}/tokenize", json={"content": p_text}, timeout=60).json()["tokens"])
        post({"prompt": p_text, "n_predict": 1, "cache_prompt": True})
        post({"prompt": [f"Stream {k} tells a story about the sea" for k in range(4)], "n_predict": 8})
        q = post({"prompt": q_text, "n_predict": 4, "cache_prompt": False, "return_tokens": True})
        again = post({"prompt": p_text, "n_predict": 1, "cache_prompt": True})
    return int(again["timings"]["cache_n"]), q["tokens"], n_p


@pytest.mark.slow
def test_a_request_without_the_prompt_cache_leaves_the_cached_prompt_alone(llama_bins, tmp_path, monkeypatch):
    """Patch 0011: a request with cache_prompt false reuses none of its slot's tokens, so llama-server no longer
    loads a cached prompt into that slot at selection (across the link, to drop it at once). The user sees two
    first: the cached prompt is still there for the next request that asks for it (stock's load takes it out of
    the cache: that request recomputes most of it). The tokens of the request itself are the same either way. (The
    link traffic it saves is counted by bench/link_bytes.py --after-streams: an rpc-server's debug log, read while
    it runs, is not a reliable count.)"""
    model = write_llama(tmp_path / "llama.gguf", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=512)
    seen = {}
    for skip in ("1", "0"):
        monkeypatch.setenv(patches.SKIP_LOAD_ENV, skip)
        seen[skip] = _unused_load(model, llama_bins)
    (reused_on, tokens_on, n_p), (reused_off, tokens_off, _) = seen["1"], seen["0"]
    assert tokens_on == tokens_off and len(tokens_on) == 4
    assert reused_on >= 0.9 * n_p, seen  # P came back from the prompt cache whole
    assert reused_off < 0.6 * n_p, seen  # stock: P was loaded for Q and dropped; only the shared start is reused


def test_the_unused_load_switch_is_0_or_1_or_one_clear_line():
    """Patch 0011 reads ARCSPLIT_SKIP_UNUSED_LOAD in llama-server (0: load as stock); arcsplit refuses a value it
    would misread before any process starts."""
    from arcsplit.errors import BadInput

    assert patches.unused_loads_skipped({}) is True
    assert patches.unused_loads_skipped({patches.SKIP_LOAD_ENV: "0"}) is False
    with pytest.raises(BadInput, match="ARCSPLIT_SKIP_UNUSED_LOAD"):
        patches.check_switches({patches.SKIP_LOAD_ENV: "no"})


def test_the_kv_gap_switch_is_a_number_of_kib_or_one_clear_line():
    """Patch 0010 reads ARCSPLIT_KV_GAP_KIB in llama-server and takes a word it cannot parse as 0 (one call per run
    of cells); arcsplit refuses one before any process starts and names the fix."""
    from arcsplit.errors import BadInput

    assert patches.kv_gap_kib({"ARCSPLIT_KV_GAP_KIB": "64"}) == 64
    assert patches.kv_gap_kib({"ARCSPLIT_KV_GAP_KIB": "0"}) == 0
    assert patches.kv_gap_kib({}) is None
    for check in (patches.kv_gap_kib, patches.check_switches):
        with pytest.raises(BadInput, match="ARCSPLIT_KV_GAP_KIB") as err:
            check({"ARCSPLIT_KV_GAP_KIB": "64k"})
        assert "whole number of KiB" in (err.value.fix or "")


def test_the_sampler_reserve_switch_is_0_or_1_or_one_clear_line():
    """Patch 0013 reads ARCSPLIT_SAMPLER_RESERVE in llama-server (1: reserve for every new chain, as stock)."""
    from arcsplit.errors import BadInput

    assert patches.sampler_reserve_each_request({}) is False
    assert patches.sampler_reserve_each_request({patches.SAMPLER_RESERVE_ENV: "1"}) is True
    with pytest.raises(BadInput, match="ARCSPLIT_SAMPLER_RESERVE"):
        patches.check_switches({patches.SAMPLER_RESERVE_ENV: "yes"})


def _sampler_reserves(llama_bins, model: Path, log: Path, reserve: str,
                      bodies: list[dict]) -> tuple[int, list[int], list[list[int]]]:
    """llama-server with --backend-sampling and one slot: the scheduler reservations its log shows once it is ready
    and after each request of ``bodies``, and the tokens of the greedy ones (those with a temperature)."""
    port = free_port()
    argv = [str(llama_bins.bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", "1024", "-np", "1", "-t", "1", "--backend-sampling", "-lv", "4", "--seed", "7"]
    env = {**os.environ, patches.SAMPLER_RESERVE_ENV: reserve}
    env.pop(patches.STOCK_ENV, None)
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            assert proc.poll() is None, log.read_text()[-2000:]
            subprocess.run(["sleep", "0.1"], check=True)
        counts = [log.read_text().count("reserve took")]
        greedy = []
        for i, body in enumerate(bodies):
            r = httpx.post(f"{url}/completion", json={"prompt": f"Story {i} about the sea", "n_predict": 8, **body},
                           timeout=120)
            r.raise_for_status()
            assert r.json()["tokens_predicted"] >= 1
            if "temperature" in body:
                greedy.append(r.json()["tokens"])
            counts.append(log.read_text().count("reserve took"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return counts[0], [c - counts[0] for c in counts[1:]], greedy


@pytest.mark.slow
def test_backend_sampling_reserves_the_scheduler_only_when_the_graph_may_grow(llama_bins, tmp_path):
    """Patch 0013: with --backend-sampling llama-server gives a slot a new sampler chain with every request (and
    takes it away at the end), and stock llama.cpp then builds a new scheduler and reserves its buffers again
    before the request's first token: on one H100 15 ms of every time to first token. Patched, a reservation comes
    only when the new chain could make the graph larger than the last reservation allowed for (a logit bias for EOS,
    ignore_eos, adds nodes); chains met before, or smaller ones, never. Clients that alternate such settings (the bench's decode ignores EOS, its prompts do not) are what
    the first attempt, keyed on the chain's make (bench/patches-tried/0012), still reserved for. The greedy tokens
    are the same as with stock's reservations (ARCSPLIT_SAMPLER_RESERVE=1)."""
    model = write_llama(tmp_path / "llama.gguf", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=512)
    bodies = [{}, {"ignore_eos": True}, {"temperature": 0, "return_tokens": True}, {"ignore_eos": True},
              {"ignore_eos": True, "temperature": 0, "return_tokens": True}, {}]
    start_on, added_on, greedy_on = _sampler_reserves(llama_bins, model, tmp_path / "on.log", "0", bodies)
    start_off, added_off, greedy_off = _sampler_reserves(llama_bins, model, tmp_path / "off.log", "1", bodies)
    assert start_on == start_off >= 1
    assert added_off == [1, 2, 3, 4, 5, 6], added_off  # stock: one reservation a request
    # patched: a chain met before (requests 3 and 5 repeat 1 and 0) or no larger never reserves; at most one
    # reservation per chain that makes the graph larger than any before it
    assert added_on[3] == added_on[2] and added_on[5] == added_on[4], added_on
    assert added_on == sorted(added_on) and added_on[-1] <= 3, added_on
    assert greedy_on == greedy_off and len(greedy_on) == 2 and all(len(g) == 8 for g in greedy_on)


@pytest.fixture(scope="module")
def set_reuse_client(llama_bins, tmp_path_factory) -> Path:
    """tests/tools/rpc_set_reuse.cpp built against the managed build's libraries and its patched tree's headers."""
    return build_set_reuse(Path(llama_bins.rpc_server).parent, tmp_path_factory.mktemp("set-reuse"))


@pytest.mark.slow  # a real rpc-server of the managed build
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "tcp"])
def test_a_big_set_leaves_from_the_callers_memory_and_only_once_it_is_sent(llama_bins, set_reuse_client, tmp_path,
                                                                          shm):
    """Patch 0014: a 32 MiB SET_TENSOR (an input into a compute buffer, a weight, the backend's asynchronous set) costs
    the client no copy of its own: no block of even a MiB is allocated while it runs, against one of the whole data
    with ARCSPLIT_RPC_IN_PLACE=0 (stock's zero-filled copy). Either way the set returns only once the data has left:
    the caller's memory, overwritten the moment the set returns, never reaches the tensor."""
    size = 32 << 20
    with rpc_server_on(llama_bins, tmp_path / "rpc.log", ARCSPLIT_RPC_SHM=shm) as port:
        for way in ("compute", "weights", "async"):
            largest = {}
            for in_place in ("1", "0"):
                env = {**os.environ, "ARCSPLIT_RPC_SHM": shm, patches.IN_PLACE_ENV: in_place}
                out = subprocess.run([str(set_reuse_client), f"127.0.0.1:{port}", str(size), way], env=env,
                                     capture_output=True, text=True, timeout=60, check=True).stdout.split()
                assert out[0] == "same", (way, in_place)
                largest[in_place] = int(out[1])
            assert largest["1"] < 1 << 20, (way, largest)
            assert largest["0"] >= size, (way, largest)
    if shm == "1":
        assert "shared-memory link" in (tmp_path / "rpc.log").read_text()


def peak_rss(pid: int) -> int:
    """A process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.mark.slow  # a real rpc-server of the managed build
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "tcp"])
def test_a_set_above_the_staging_block_costs_the_rpc_server_no_block_of_its_size(llama_bins, set_reuse_client,
                                                                                 tmp_path, shm):
    """Patch 0003: a 160 MiB weight sent over the link (a remote rpc-server without the GGUF, or --no-rpc-seed) is
    received in pieces, on a CPU rpc-server straight into the tensor: the server's peak memory grows by the tensor
    alone, against twice its size with ARCSPLIT_RPC_SET_PIECES=0 (stock's zero-filled block of the whole). The
    tensor reads back as set either way (in 16 MiB gets, so the reply's block stays small)."""
    size = 160 << 20
    grew = {}
    for pieces in ("1", "0"):
        env = {"ARCSPLIT_RPC_SHM": shm, patches.SET_PIECES_ENV: pieces}
        with rpc_server_proc(llama_bins, tmp_path / f"rpc-{pieces}.log", **env) as (proc, port):
            before = peak_rss(proc.pid)
            out = subprocess.run([str(set_reuse_client), f"127.0.0.1:{port}", str(size), "weights", str(16 << 20)],
                                 env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
                                 check=True).stdout.split()
            assert out[0] == "same", pieces
            grew[pieces] = peak_rss(proc.pid) - before
    assert grew["1"] < size + (40 << 20), grew
    assert grew["0"] >= 2 * size - (8 << 20), grew


def test_the_in_place_switch_is_0_or_1_or_one_clear_line():
    """ARCSPLIT_RPC_IN_PLACE (patch 0014) is on unless 0; any other word is refused before a process starts."""
    assert patches.sets_in_place({}) is True
    assert patches.sets_in_place({patches.IN_PLACE_ENV: "0"}) is False
    assert patches.sets_in_pieces({}) is True and patches.sets_in_pieces({patches.SET_PIECES_ENV: "0"}) is False
    with pytest.raises(BadInput) as err:
        patches.check_switches({patches.SET_PIECES_ENV: "no"})
    assert patches.SET_PIECES_ENV in err.value.problem
    with pytest.raises(BadInput) as err:
        patches.check_switches({patches.IN_PLACE_ENV: "off"})
    assert patches.IN_PLACE_ENV in err.value.problem and "=0" in (err.value.fix or "")
