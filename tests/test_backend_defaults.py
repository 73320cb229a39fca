"""Per-backend defaults a user relies on: flash attention (off on SYCL, from a B60 report) and the stop grace
(longer on SYCL, configurable with `serve --stop-grace`). docs/runtime.md says what each rests on."""

from __future__ import annotations

import pytest

from arcsplit import backends
from arcsplit.errors import BadInput
from arcsplit.model import load_profile
from arcsplit.rig import Card, Rig
from arcsplit.decide.prepare import ServeRequest, plan_for_mode, prepare
from arcsplit.synth import write_llama

G = 1 << 30


def test_flash_attention_default_per_backend():
    assert backends.get("sycl").flash_attn is False
    assert all(backends.get(b).flash_attn for b in ("cpu", "cuda", "vulkan"))
    # llama.cpp refuses a quantized V cache without flash attention: that wins over the backend's default
    assert backends.flash_attn_default("sycl") is False and backends.flash_attn_default("sycl", "q8_0") is True


@pytest.mark.parametrize("backend, fa", [("sycl", "off"), ("cuda", "on"), ("vulkan", "on")])
def test_the_served_plan_carries_the_backends_flash_attention(tmp_path, backend, fa):
    model = tmp_path / "m.gguf"
    write_llama(model, n_layer=4, n_embd=64)
    rig = Rig(tuple(Card(backend, i, f"{backend} card {i}", 16 * G, 16 * G) for i in (0, 1)))
    req = ServeRequest(model=str(model), gpus=[0, 1], backend=backend)
    for mode in ("multi", "hybrid"):
        args = plan_for_mode(load_profile(model), rig, req, mode).llama_server_args()
        assert args[args.index("-fa") + 1] == fa, mode


def test_stop_grace_is_longer_on_sycl_than_on_cpu():
    assert backends.get("sycl").stop_grace_s > backends.get("cpu").stop_grace_s == 10.0


@pytest.mark.slow  # needs the llama.cpp build
def test_stop_grace_from_the_request_or_the_backend(llama_bins, demo_model):
    assert prepare(ServeRequest(model=str(demo_model), gpus=[0, 1], backend="cpu", port=18931)).stop_grace == 10.0
    assert prepare(ServeRequest(model=str(demo_model), gpus=[0, 1], backend="cpu", port=18931, stop_grace=45)).stop_grace == 45
    with pytest.raises(BadInput, match="--stop-grace"):
        prepare(ServeRequest(model=str(demo_model), gpus=[0, 1], backend="cpu", port=18931, stop_grace=-1))


@pytest.mark.slow  # needs the llama.cpp build
def test_serve_stop_grace_out_of_range_is_one_line_exit_2(llama_bins, demo_model, capsys):
    from arcsplit.cli import main

    for bad, said in (("--stop-grace=-5", "--stop-grace: '-5' is not a duration"),
                      ("--stop-grace=2h", "--stop-grace: '2h' is too long")):
        with pytest.raises(SystemExit) as ended:  # the flag's parser: one usage line, exit 2, nothing started
            main(["serve", str(demo_model), "--gpus", "0,1", "--backend", "cpu", "--port", "18934", bad])
        assert ended.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
