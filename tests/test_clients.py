"""Real clients against a real split: LangChain's OpenAI chat model and LiteLLM, each asking the chat demo model
(SmolLM2 135M Instruct, two CPU rpc-servers) a question, plain and streamed. The OpenAI SDK is in test_serve.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _instance import isolated_env, running_instance  # noqa: E402

from arcsplit.demo import ensure_chat_model  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning")]  # litellm
QUESTION = "Name the capital of France."


@pytest.fixture(scope="module")
def url(tmp_path_factory, llama_bins) -> str:
    with isolated_env(tmp_path_factory.mktemp("clients"), llama_bins.bin_dir):
        with running_instance(ensure_chat_model(), telemetry_interval=None) as inst:
            yield inst.url


def test_langchain_chat_openai(url):
    openai_chat = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = openai_chat.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="arcsplit", temperature=0,
                                 max_tokens=32, max_retries=0, timeout=120)
    assert "Paris" in llm.invoke(QUESTION).content
    assert "Paris" in "".join(chunk.content for chunk in llm.stream(QUESTION))


def test_litellm_completion(url, monkeypatch):
    # litellm fetches its model price map from the network on import unless told to use its bundled copy
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm", reason="litellm is not installed")
    messages = [{"role": "user", "content": QUESTION}]
    common = dict(model="openai/arcsplit", api_base=f"{url}/v1", api_key="unused", temperature=0, max_tokens=32,
                  timeout=120)
    reply = litellm.completion(messages=messages, **common)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    stream = litellm.completion(messages=messages, stream=True, **common)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream)


def test_demo_prints_a_request_that_names_the_served_model(tmp_path, llama_bins):
    """`arcsplit demo`'s printed request, sent as printed: its model is what /v1/models lists (not a path)."""
    import json
    import os
    import re
    import signal
    import subprocess

    import httpx

    from arcsplit.proc.ports import free_port

    ensure_chat_model()  # in the user's cache, where the demo looks
    port = free_port()
    env = {**os.environ, "ARCSPLIT_STATE_DIR": str(tmp_path / "state"), "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt"),
           "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "demo", "--port", str(port), "--cpu-memory", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        printed = ""
        for line in proc.stdout:
            printed += line
            if "or open http" in line:
                break
        body = json.loads(re.search(r"-d '(\{.*\})'", printed).group(1))
        url = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == [body["model"]]
        assert "/" not in body["model"]
        reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 16}, timeout=120)
        assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
