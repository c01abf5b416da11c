"""Agent frameworks against a live paged-serve, unchanged: LangChain's ``ChatOpenAI`` with
``bind_tools`` on the random Qwen2 checkpoint with Qwen2.5's tool-calling template."""

from __future__ import annotations

import jsonschema
import pytest

from .test_tools import SCHEMAS, TOOLS, qwen_tools_ckpt, served  # noqa: F401  (fixtures)


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_langchain_bind_tools_gets_calls_that_validate(served, choice):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=served.live.url + "/v1", api_key="unused", model="qwen-tools",
                     temperature=0, max_tokens=120, max_retries=0, timeout=30)
    # LangChain's "any" is OpenAI's "required"; a name is the named function
    bound = llm.bind_tools(TOOLS, tool_choice=choice, parallel_tool_calls=False)
    reply = bound.invoke([HumanMessage("weather in Paris?")])
    assert isinstance(reply, AIMessage) and reply.tool_calls, reply
    for call in reply.tool_calls:
        if choice != "any":
            assert call["name"] == choice
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    history = [HumanMessage("weather in Paris?"), reply] + [
        ToolMessage('{"temperature": 21}', tool_call_id=c["id"]) for c in reply.tool_calls]
    final = llm.bind_tools(TOOLS).invoke(history)  # auto: an answer or more valid calls
    assert isinstance(final, AIMessage)
    for call in final.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
