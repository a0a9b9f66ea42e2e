"""DeepSeek V4 Flash's `ChatProtocol`: the prompt template (template.py), DSML tool calls
(dsml.py) and the streaming output parser (output.py) of this folder, behind the interface
every family shares (chat/protocol.py)."""

from __future__ import annotations

from typing import Any

from ... import markers as M
from ...messages import Conversation
from ...protocol import ChatProtocol, register, register_template
from . import dsml, official, template
from .output import DsmlCalls


class DeepSeekV4Protocol(ChatProtocol):
    family = "deepseek_v4"
    model_id = M.DEEPSEEK_V4_MODEL_ID
    model_name = "DeepSeek V4 Flash"
    aliases = (M.DEEPSEEK_V4_CHAT_ALIAS, M.DEEPSEEK_V4_REASONER_ALIAS)
    chat_aliases = (M.DEEPSEEK_V4_CHAT_ALIAS,)
    reasoner_aliases = (M.DEEPSEEK_V4_REASONER_ALIAS,)
    bos = M.BOS
    eos = M.EOS
    think_open = M.THINK_OPEN
    think_close = M.THINK_CLOSE
    stop_strings = ()
    special_strings = M.SPECIAL_STRINGS
    turn_end = M.EOS
    default_mode = "high"
    call_format = DsmlCalls(M.DSML_SYNTAXES, dsml.render_calls)

    def thinking_enabled(self, mode: str) -> bool:
        return template.thinking_enabled(mode)

    def resolve_thinking(
        self, mode: str, effort: Any = None, *, explicit: bool = False, model: str | None = None, ctx: int = 32768
    ) -> str:
        return mode  # the API parser already resolved V4's none/high/max

    def render(self, conv: Conversation, tool_memory=None) -> str:
        return template.render(conv, tool_memory)

    def render_completion(self, prompt: str, thinking: str = "high") -> str:
        return template.render_completion(prompt, thinking)

    def render_continuation_tail(self, conv: Conversation, start: int, tool_memory=None) -> str | None:
        return template.render_continuation_tail(conv, start, tool_memory)

    def uses_tool_context(self, conv: Conversation) -> bool:
        return template.uses_tool_context(conv)

    def force_text(self, name: str | None) -> str:
        syn = M.DSML_FULL
        head = M.DSML_BLOCK_SEPARATOR + syn.open + "\n" + syn.invoke + ' name="'
        return head if name is None else head + dsml.attr_escape(name) + '">\n'

    def strict_call_grammar(self, tools: dict, named: str | None, literal, json_term) -> str | None:
        return dsml.strict_call_grammar(tools, named, literal, json_term)


register(DeepSeekV4Protocol())


class DeepSeekV4OfficialProtocol(DeepSeekV4Protocol):
    """`--chat-template official`: prompts byte for byte as DeepSeek's own encoder writes
    them (official.py, docs/chat-template.md §11); output parsing is ds4's.  Tool calls in
    the history are always rendered the encoder's way (no exact replay of sampled blocks)."""

    chat_template = M.CHAT_TEMPLATE_OFFICIAL

    def render(self, conv: Conversation, tool_memory=None) -> str:
        return official.render(conv)

    def render_history(self, conv: Conversation, tool_memory=None) -> str:
        return official.render(conv)  # a conversation ending with an assistant turn gets no prompt

    def render_continuation_tail(self, conv: Conversation, start: int, tool_memory=None) -> str | None:
        return ChatProtocol.render_continuation_tail(self, conv, start, tool_memory)

    def uses_tool_context(self, conv: Conversation) -> bool:
        return official.keeps_reasoning(conv)


register_template(DeepSeekV4OfficialProtocol())
