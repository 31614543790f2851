"""One call through the gateway with an agent framework, run in the agent clients' own
virtualenv (scripts/setup.sh: ``<agents>/venv/bin/python tests/agent_clients.py CLIENT``).

Clients: ``agents-responses`` (OpenAI Agents SDK, ``OpenAIResponsesModel``),
``agents-chat`` (``OpenAIChatCompletionsModel``), ``langchain-openai`` (``ChatOpenAI``,
Chat Completions), ``langchain-anthropic`` (``ChatAnthropic``, Messages). Each makes one
model call with ``--max-tokens`` and prints one JSON line: ``{"text": str}``. No retries,
120 s per call; the Agents SDK's trace export (to OpenAI) is off. This file imports none of
tokengate: the frameworks' dependency ranges are not the main venv's.
"""

from __future__ import annotations

import argparse
import json

TASK = "Say hello in one word."
TIMEOUT_S = 120.0


def agents_sdk(base_url: str, key: str, model: str, max_tokens: int, responses: bool) -> str:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S)
    llm = (OpenAIResponsesModel(model=model, openai_client=client) if responses
           else OpenAIChatCompletionsModel(model=model, openai_client=client))
    agent = Agent(name="assistant", instructions="You are terse.", model=llm,
                  model_settings=ModelSettings(max_tokens=max_tokens))
    return str(Runner.run_sync(agent, TASK, max_turns=1).final_output)


def langchain(base_url: str, key: str, model: str, max_tokens: int, anthropic: bool) -> str:
    if anthropic:
        from langchain_anthropic import ChatAnthropic

        chat = ChatAnthropic(model_name=model, base_url=base_url.removesuffix("/v1"),
                             api_key=key, max_tokens=max_tokens, max_retries=0,
                             timeout=TIMEOUT_S, stop=None)
    else:
        from langchain_openai import ChatOpenAI

        chat = ChatOpenAI(model=model, base_url=base_url, api_key=key,  # type: ignore[arg-type]
                          max_tokens=max_tokens, max_retries=0, timeout=TIMEOUT_S)
    return str(chat.invoke(TASK).content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("client", choices=["agents-responses", "agents-chat",
                                           "langchain-openai", "langchain-anthropic"])
    parser.add_argument("--base-url", required=True, help="the gateway's .../v1")
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    a = parser.parse_args()
    if a.client.startswith("agents-"):
        text = agents_sdk(a.base_url, a.key, a.model, a.max_tokens,
                          responses=a.client == "agents-responses")
    else:
        text = langchain(a.base_url, a.key, a.model, a.max_tokens,
                         anthropic=a.client == "langchain-anthropic")
    print(json.dumps({"text": text}))


if __name__ == "__main__":
    main()
