"""Engines started from disk answer as plain vLLM does: the README's own path (`pdcluster serve`,
SmolLM2, through the openai client as a new user would) and the tiny model behind the router."""

from __future__ import annotations

import openai
import pytest
from oracle import QUESTION, assert_conforms

from loadtest.local_cluster import LocalServer

pytestmark = pytest.mark.slow


@pytest.mark.oracles("smollm2")
def test_the_readme_path_answers_the_capital_of_france(artifacts, oracle):
    with LocalServer([], artifacts / "serve-readme-smollm2.log") as server:  # `make serve`: the defaults
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12
        )
        assert "Paris" in answer.choices[0].message.content
        assert_conforms(server.url, "smollm2", oracle("smollm2"))  # computed while the server started


@pytest.mark.oracles("tiny")
def test_the_tiny_model_behind_the_router(served, oracle):
    assert_conforms(served.url, "tiny", oracle("tiny"))
