"""The rpc-servers' weight cache seeded from the local GGUF (patch 0006, arcsplit/decide/weightcache.py).

Fast: the argv/env arcsplit gives a seeded group and how the cache is pruned. Slow (the real CPU build, real
sockets): the weights do not cross the socket, greedy output is the same seeded or not, a peer with the patch
switched off (ARCSPLIT_RPC_STOCK=1, the stock code path) still works both ways, and the cache holds no copy.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from arcsplit import serve as serve_group
from arcsplit.errors import LlamaError
from arcsplit.llama import seeding
from arcsplit.llama.patches import STOCK_ENV
from arcsplit.decide import weightcache
from arcsplit.run import supervisor
from arcsplit.proc.ports import free_port
from arcsplit.decide.prepare import ServeRequest, prepare
from arcsplit.decide.specs import build_specs
from arcsplit.synth import write_llama

from test_hosts_plan import _config as _hosts_config, untied  # noqa: F401 (a fixture)
from test_specs import config, flag, specs_for

MiB = 1024 * 1024


def test_a_seeded_group_serves_weights_from_the_gguf_and_a_restart_does_too():
    """Every rpc-server gets -c and --seed-cache for every file of the model (the supervisor restarts a killed one
    with the same argv, so recovery reads the file too); llama-server learns where the index is."""
    cfg = config("cuda", "rpc", [0, 1], rpc_cache_dir="/c", rpc_seed=("/models/m.gguf",))
    *rpcs, server = specs_for(cfg)
    for rpc in rpcs:
        assert "-c" in rpc.argv and flag(list(rpc.argv), "--seed-cache") == "/models/m.gguf"
        assert rpc.env_dict["LLAMA_CACHE"] == "/c"
    assert server.env_dict[weightcache.INDEX_ENV] == "/c/rpc"
    plain = specs_for(config("cuda", "rpc", [0, 1]))
    assert all("--seed-cache" not in s.argv and "-c" not in s.argv[:-1] for s in plain[:-1])
    assert weightcache.INDEX_ENV not in plain[-1].env_dict
    shards = config("cuda", "hybrid", [0, 1], rpc_cache_dir="/c", rpc_seed=("/m-00001.gguf", "/m-00002.gguf"))
    argv = list(specs_for(shards)[0].argv)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--seed-cache"] == ["/m-00001.gguf", "/m-00002.gguf"]



def test_rpc_servers_on_other_hosts_seed_from_their_own_copy(untied):  # noqa: F811 (the fixture)
    """A layout's rpc-server on another host reads the same file from that host's disk: this machine's path, or
    its model_dir + the file's name; it keeps its node's own -c cache (no cache path of this machine)."""
    config = replace(_hosts_config(untied), rpc_seed=("/models/m.gguf",))
    specs = build_specs(config, [50052, 50053, 50054], [41000])
    local = [s for s in specs if s.role == "rpc" and not s.node]
    remote = [s for s in specs if s.role == "rpc" and s.node]
    assert local and remote
    assert all(flag(list(s.argv), "--seed-cache") == "/models/m.gguf" for s in local)
    assert all(flag(list(s.argv), "--seed-cache") == "/models/m.gguf" and "-c" in s.argv
               and "LLAMA_CACHE" not in s.env_dict for s in remote)
    hosts = tuple(replace(h, model_dir="/srv/gguf") for h in config.hosts)
    specs = build_specs(replace(config, hosts=hosts), [50052, 50053, 50054], [41000])
    assert all(flag(list(s.argv), "--seed-cache") == "/srv/gguf/m.gguf" for s in specs if s.role == "rpc" and s.node)


def test_a_build_without_the_patch_does_not_seed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / ".arcsplit-patches").write_text("abc\n0001-rpc-async-uploads\n")
    assert not seeding.can_seed(bin_dir / "ggml-rpc-server", None)
    (bin_dir / ".arcsplit-patches").write_text(f"abc\n0001-rpc-async-uploads\n{seeding.PATCH}\n")
    assert seeding.can_seed(bin_dir / "ggml-rpc-server", None)
    assert not seeding.can_seed(bin_dir / "ggml-rpc-server", frozenset({"-c", "-t"}))  # a foreign build


def _index_for(gguf: Path, root: Path) -> Path:
    index = weightcache.index_of(gguf, root)
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(f"ggml-rpc-fnv-index 1\n{gguf}\n0123456789abcdef 64 1048576\n")
    return index


def test_prune_drops_stale_indexes_and_old_copies_and_keeps_the_rest(tmp_path):
    root = tmp_path / "cache"
    kept_model, changed_model, gone_model = (tmp_path / f"{n}.gguf" for n in ("kept", "changed", "gone"))
    for m in (kept_model, changed_model, gone_model):
        m.write_bytes(b"GGUF" + bytes(64))
    kept, changed, gone = (_index_for(m, root) for m in (kept_model, changed_model, gone_model))
    changed_model.write_bytes(b"GGUF" + bytes(65))  # edited after indexing: another identity
    gone_model.unlink()
    store = weightcache.store(root)
    now = time.time()
    copies = []
    for i in range(4):  # llama.cpp's own entries: full copies, oldest first
        c = store / f"{i:016x}"
        c.write_bytes(bytes(MiB))
        os.utime(c, (now - 100 + i, now - 100 + i))
        copies.append(c)
    old_tmp, new_tmp = store / f"{kept.name}.tmp123", store / f"{kept.name}.tmp456"
    for t, age in ((old_tmp, 7200), (new_tmp, 5)):
        t.write_text("partial")
        os.utime(t, (now - age, now - age))
    other = store / "notes.txt"
    other.write_text("not ours")

    pruned = weightcache.prune(root, keep_copy_bytes=2 * MiB, now=now)

    assert kept.exists() and not changed.exists() and not gone.exists()
    assert [c.exists() for c in copies] == [False, False, True, True]  # the two newest fit the bound
    assert not old_tmp.exists() and new_tmp.exists()  # a fresh one may be an rpc-server indexing right now
    assert other.exists()
    assert (pruned.indexes, pruned.copies) == (2, 2)
    assert pruned.kept_bytes == kept.stat().st_size + 2 * MiB
    assert weightcache.prune(root, keep_copy_bytes=0, now=now).copies == 2
    assert not any(c.exists() for c in copies) and kept.exists()


def test_prune_of_a_cache_that_does_not_exist_is_nothing(tmp_path):
    assert weightcache.prune(tmp_path / "none", 0) == weightcache.Pruned(0, 0, 0, 0)


def test_indexing_before_the_group_starts_fails_with_the_fix_when_the_binary_cannot(tmp_path):
    """A binary that does not index (here /bin/true: exits 0 and writes nothing, as an rpc-server without
    --seed-only does after printing its usage) is one error naming the way out, not a group that hangs."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    true = shutil.which("true")
    if true is None:
        pytest.skip("no `true` binary on PATH")
    with pytest.raises(LlamaError, match="--no-rpc-seed"):
        weightcache.ensure_index(true, str(tmp_path / "c"), [str(model)], dict(os.environ))
    index = weightcache.index_of(model, tmp_path / "c")
    index.parent.mkdir(parents=True)
    index.write_text(f"{weightcache.INDEX_MAGIC}\n{model}\n")
    assert weightcache.ensure_index(true, str(tmp_path / "c"), [str(model)], dict(os.environ)) is None


def test_an_index_of_an_older_version_is_rebuilt_before_the_group_starts(tmp_path):
    """Version 1 listed tensors from 1 MiB only: serve runs the indexer again (a real build rewrites it, see the
    real-build test below); a build that predates version 2 keeps its own index, which is no error."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    index = weightcache.index_of(model, tmp_path / "c")
    index.parent.mkdir(parents=True)
    index.write_text(f"ggml-rpc-fnv-index 1\n{model}\n")
    marker = tmp_path / "ran"
    indexer = tmp_path / "indexer"
    indexer.write_text(f"#!/bin/sh\ntouch {marker}\n")
    indexer.chmod(0o755)
    took = weightcache.ensure_index(str(indexer), str(tmp_path / "c"), [str(model)], dict(os.environ))
    assert marker.exists() and took is not None


# -- the real build ---------------------------------------------------------------------------------------------

PROMPT = "Once upon a time"
SET_TENSOR = re.compile(r"\[set_tensor\] .*size: (\d+)")
HASH_HIT = re.compile(r"\[set_tensor_hash\] .*size: (\d+)")
KV = 1024 * 128 * 2  # bytes of one K or V weight of _model: indexed since version 2 of the index (from 64 KiB)


def _model(tmp_path: Path) -> Path:
    """Small, but with weights from 256 KiB (K and V: 1024 x 128 F16; the index covers them from 64 KiB) up to above
    llama.cpp's 10 MiB threshold."""
    return write_llama(tmp_path / "llama.gguf", n_layer=4, n_embd=1024, n_head=8, n_head_kv=1, n_ff=2816,
                       n_vocab=6000)


def _serve(llama_bins, model: Path, mode: str, seed: bool):
    """A CPU group of two CPU cards; seeded (arcsplit's default with this build) or weights over the socket."""
    return serve_group(str(model), gpus=[0, 1], backend="cpu", mode=mode, ctx=512, parallel=1, threads=1,
                       port=free_port(), bus=False, llama_dir=str(llama_bins.bin_dir), rpc_seed=seed,
                       cpu_memory_mib=1024)


def _greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0, "top_k": 1,
                                              "cache_prompt": False, "return_tokens": True}, timeout=300)
    r.raise_for_status()
    return r.json()["tokens"]


def _wire(server) -> tuple[list[int], list[int]]:
    """(sizes of SET_TENSOR received, sizes served by SET_TENSOR_HASH hits) over every rpc-server's log."""
    run_dir = Path(server.status()["run_dir"])
    sent, hits = [], []
    for log in run_dir.glob("rpc*.log"):
        text = log.read_text(errors="replace")
        sent += [int(m) for m in SET_TENSOR.findall(text)]
        hits += [int(m) for m in HASH_HIT.findall(text)]
    return sent, hits


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "arcsplit-cache"))
    monkeypatch.setenv("GGML_RPC_DEBUG", "1")
    monkeypatch.delenv(STOCK_ENV, raising=False)
    return tmp_path / "arcsplit-cache" / "rpc-cache"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hybrid", "rpc"])
def test_seeded_weights_never_cross_the_socket_and_greedy_output_is_the_same(llama_bins, tmp_path, cache, mode):
    model = _model(tmp_path)
    with _serve(llama_bins, model, mode, seed=False) as server:
        plain = _greedy(server.url)
        sent_plain, _ = _wire(server)
    assert max(sent_plain) >= 10 * MiB  # without the seed the big weights go through the socket
    with _serve(llama_bins, model, mode, seed=True) as server:
        seeded = _greedy(server.url)
        sent, hits = _wire(server)
        logs = "\n".join(server.logs("rpc0", 500))
    assert seeded == plain
    assert "Seeded cache from" in logs
    assert hits and max(hits) >= 10 * MiB  # served from the file: big weights, and the 256 KiB K and V ones
    assert KV in hits and KV not in sent, sorted(sent)[-5:]
    assert all(size < MiB for size in sent), sorted(sent)[-5:]  # only small tensors and activations crossed
    store = weightcache.store(cache)
    assert [p.suffix for p in store.iterdir()] == [".fnvidx"]  # one index, no copy of any weight
    assert store.joinpath(weightcache.index_of(model, cache).name).stat().st_size < 64 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("stock_side", ["server", "rpc"])
def test_a_peer_with_the_patch_off_still_works(llama_bins, tmp_path, cache, monkeypatch, stock_side):
    """ARCSPLIT_RPC_STOCK=1 runs the stock code path of one side. A stock llama-server hashes the weights itself
    (the same FNV-1a) and still gets hits from the seeded rpc-server; a stock rpc-server ignores the index, so the
    patched llama-server's offers miss and it sends the weights, as stock does. Same greedy tokens either way."""
    model = _model(tmp_path)
    with _serve(llama_bins, model, "hybrid", seed=False) as server:
        plain = _greedy(server.url)

    def one_side_stock(cfg, *ports):  # the same group, the patch switched off in one process only
        return tuple(replace(s, env=tuple(sorted({**s.env_dict, STOCK_ENV: "1"}.items())))
                     if s.role == stock_side else s for s in build_specs(cfg, *ports))

    monkeypatch.setattr(supervisor, "build_specs", one_side_stock)
    with _serve(llama_bins, model, "hybrid", seed=True) as server:
        tokens = _greedy(server.url)
        sent, hits = _wire(server)
    assert tokens == plain
    if stock_side == "server":  # stock client, seeded server: hits for every weight above 10 MiB
        assert hits and max(sent) < 10 * MiB
    else:  # stock server: no hit, the weights went through the socket, and its -c cache kept copies of them
        assert not hits and max(sent) >= 10 * MiB
        store = weightcache.store(cache)
        copies = [p for p in store.iterdir() if p.suffix != ".fnvidx"]
        assert copies
        # the next group's preparation removes them (no --rpc-cache: no copy is kept) and says so
        prepared = prepare(ServeRequest(model=str(model), gpus=[0, 1], backend="cpu", mode="hybrid",
                                        llama_dir=str(llama_bins.bin_dir), port=free_port(), cpu_memory_mib=1024))
        assert not any(p.exists() for p in copies) and [p.suffix for p in store.iterdir()] == [".fnvidx"]
        assert any(f"{len(copies)} weight copies" in n for n in prepared.notes), prepared.notes


@pytest.mark.slow
def test_the_model_is_indexed_once_before_any_rpc_server_starts(llama_bins, tmp_path):
    """rpc-server --seed-only writes the index and exits; a second call finds it. The hash of an entry is FNV-1a
    64 of exactly the bytes at its offset (checked here independently, in Python, on the smallest entry)."""
    model = _model(tmp_path)
    root = tmp_path / "c"
    assert weightcache.ensure_index(str(llama_bins.rpc_server), str(root), [str(model)], dict(os.environ)) is not None
    lines = weightcache.index_of(model, root).read_text().splitlines()
    assert lines[:2] == [weightcache.INDEX_MAGIC, str(model)] and len(lines) > 2
    entries = [(int(h, 16), int(off), int(n)) for h, off, n in (line.split() for line in lines[2:])]
    assert all(n >= 64 * 1024 for _, _, n in entries) and min(n for _, _, n in entries) == KV
    want, off, n = min(entries, key=lambda e: e[2])
    h = 0xCBF29CE484222325
    with model.open("rb") as fh:
        fh.seek(off)
        for byte in fh.read(n):
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    assert h == want
    assert weightcache.ensure_index(str(llama_bins.rpc_server), str(root), [str(model)], dict(os.environ)) is None
    # an index of version 1 (tensors from 1 MiB only, as the patch wrote before) is rewritten by the next start's
    # indexing, so the middle-sized weights stop crossing the socket after an upgrade
    index = weightcache.index_of(model, root)
    index.write_text("\n".join(["ggml-rpc-fnv-index 1", str(model), *(x for x in lines[2:] if int(x.split()[2]) >= MiB)])
                     + "\n")
    assert weightcache.ensure_index(str(llama_bins.rpc_server), str(root), [str(model)], dict(os.environ)) is not None
    assert index.read_text().splitlines() == lines
