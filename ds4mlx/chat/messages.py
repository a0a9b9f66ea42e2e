"""The normalized chat request every API is turned into (chat-template spec §2)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object (or free text for custom tools)


@dataclass
class Message:
    role: str  # system | developer | user | assistant | tool | function
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_ids: list[str] = field(default_factory=list)  # ids of tool results carried here


@dataclass
class Conversation:
    messages: list[Message]
    tool_schemas: list[str] = field(default_factory=list)  # one rendered schema line per tool
    tools_active: bool = False  # schemas non-empty and tool_choice is not "none"
    thinking: str = "high"  # none | high | max
