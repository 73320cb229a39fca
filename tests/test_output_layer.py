"""The output layer on llama-server's own card in a hybrid group (``--output-layer local``), served for real.

On GPUs arcsplit does this by itself (the logits then never cross the RPC link); the CPU build here runs the same
flags with llama-server's CPU as the local card: the weights really move (the rpc-server's buffer shrinks by the
output layer, as planned) and the text is the same as with llama.cpp's own placement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

import arcsplit
from arcsplit import synth
from arcsplit.model import load_profile
from arcsplit.proc.ports import free_port
from _instance import isolated_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def isolated(tmp_path_factory: pytest.TempPathFactory, llama_bins) -> Iterator[None]:
    with isolated_env(tmp_path_factory.mktemp("arcsplit-out"), llama_bins.bin_dir):
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied output (output.weight of its own): 8192 x 256 f16, 4 MiB, as big as all its layers together."""
    return synth.write_llama(tmp_path_factory.mktemp("m") / "untied.gguf", n_layer=8, n_embd=256, n_head=8,
                             n_head_kv=4, n_ff=512, n_vocab=8192)


def run(model: Path, output_layer: str) -> tuple[list[int], dict, arcsplit.Plan, list[str]]:
    with arcsplit.serve(model, gpus=[0, 1], backend="cpu", mode="hybrid", ctx=1024, threads=1, port=free_port(),
                        output_layer=output_layer, bus=False) as srv:
        r = httpx.post(f"{srv.url}/completion", json={"prompt": "one two three", "n_predict": 12, "temperature": 0,
                                                      "top_k": 1, "return_tokens": True}, timeout=120)
        r.raise_for_status()
        st = srv.status()
        return r.json()["tokens"], st["buffers"], srv.plan, list(st["processes"]["server"]["argv"])


def test_output_layer_local_moves_weights_and_keeps_the_text(model: Path) -> None:
    out_bytes = load_profile(model).output_bytes
    local_tokens, local_buf, local_plan, local_argv = run(model, "local")
    last_tokens, last_buf, last_plan, last_argv = run(model, "last")

    assert local_argv[local_argv.index("-ot") + 1] == "^output=CPU" and "-ot" not in last_argv
    assert local_plan.cards[0].has_output and not local_plan.cards[-1].has_output
    assert last_plan.cards[-1].has_output
    # the rpc-server's card holds the output layer only with llama.cpp's placement: as planned, both ways
    rpc_local = local_buf["cards"][-1]["actual"]["model"]
    rpc_last = last_buf["cards"][-1]["actual"]["model"]
    assert abs((rpc_last - rpc_local) - out_bytes) <= 0.02 * out_bytes, (rpc_last, rpc_local, out_bytes)
    for buf, plan in ((local_buf, local_plan), (last_buf, last_plan)):
        assert abs(buf["cards"][-1]["actual"]["model"] - plan.cards[-1].weights) <= 0.05 * plan.cards[-1].weights
    assert local_tokens == last_tokens and len(local_tokens) == 12

