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
