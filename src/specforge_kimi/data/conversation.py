"""Conversation records in the two input formats we accept, normalised to one typed form.

Formats (one JSON object per JSONL line):

- OpenAI messages: ``{"messages": [...], "tools": [...]}``. Roles ``system``, ``user``,
  ``assistant`` (with optional ``reasoning_content`` and ``tool_calls``) and ``tool`` (with
  ``tool_call_id``, optional ``name``). ``content`` is a string, ``null`` or a list of parts
  (``text``, ``image``/``image_url``, ``video``/``video_url``).
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": "...",
  "tools": [...]}``; ``from`` is ``system``/``human``/``user``/``gpt``/``assistant``/``tool``.
  Items written as ``{"role", "content"}`` (SpecForge's own ShareGPT variant) are accepted too,
  and so are the OpenAI per-message keys (``reasoning_content``, ``tool_calls``, ...).

Normalisations (each one is what the K2.5 chat path would do with the same data anyway):
``tools`` given as a JSON string are parsed and bare function dicts are wrapped as
``{"type": "function", "function": ...}`` (SGLang's API only takes the wrapped form);
``tool_calls`` given as a JSON string are parsed; a tool call without an id gets
``functions.NAME:IDX`` (IDX counts tool calls across the conversation, K2's convention); a tool
message without ``tool_call_id`` takes the next unanswered call's id; ``reasoning_content: null``
means no reasoning.

Scope: validation errors raise :class:`~specforge_kimi.errors.KimiInputError` naming the
message index and the problem. Whether a conversation is usable for training (has an assistant
turn, has media) is decided by the callers, not here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from specforge_kimi.errors import KimiInputError

__all__ = [
    "Conversation",
    "Message",
    "Role",
    "ToolCall",
    "conversation_from_record",
    "conversation_to_openai",
]

Role = Literal["system", "user", "assistant", "tool"]

_SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
_TEXT_PART_TYPES = frozenset({"text"})
_MEDIA_PART_TYPES = frozenset({"image", "image_url", "video", "video_url"})


@dataclass(frozen=True)
class ToolCall:
    """One assistant tool call. ``arguments`` is kept as given: a string is rendered verbatim,
    a dict is JSON-dumped by the template."""

    id: str
    name: str
    arguments: str | dict[str, Any]


@dataclass(frozen=True)
class Message:
    """One turn. ``content`` is a string or a tuple of content-part dicts (text/image/video)."""

    role: Role
    content: str | tuple[Mapping[str, Any], ...] = ""
    name: str | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @property
    def has_media(self) -> bool:
        """True if any content part is an image or a video."""
        if isinstance(self.content, str):
            return False
        return any(part.get("type") in _MEDIA_PART_TYPES for part in self.content)


@dataclass(frozen=True)
class Conversation:
    """A validated conversation plus the tools it may call (OpenAI tool dicts)."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def has_media(self) -> bool:
        return any(message.has_media for message in self.messages)

    @property
    def assistant_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m.role == "assistant"]


def conversation_from_record(record: Any) -> Conversation:
    """Validate one JSONL record (OpenAI ``messages`` or ShareGPT ``conversations``)."""
    if not isinstance(record, dict):
        raise KimiInputError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        raw_messages = record["messages"]
        source = "messages"
    elif "conversations" in record:
        raw_messages = record["conversations"]
        source = "conversations"
    else:
        names = sorted(record)  # the input's own strings: quoted (a newline stays on the error's one line), capped
        keys = ", ".join(repr(k) for k in names[:8]) + (f", ... ({len(names)} keys)" if len(names) > 8 else "")
        keys = keys or "none"
        raise KimiInputError(f"record has neither 'messages' nor 'conversations' (keys: {keys})")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise KimiInputError(f"'{source}' must be a non-empty list")

    messages: list[Message] = []
    system = record.get("system")
    if source == "conversations" and system not in (None, ""):
        if not isinstance(system, str):
            raise KimiInputError("'system' must be a string")
        messages.append(Message(role="system", content=system))

    call_counter = 0
    unanswered: list[str] = []
    for index, raw in enumerate(raw_messages):
        where = f"{source}[{index}]"
        if not isinstance(raw, dict):
            raise KimiInputError(f"{where} must be an object, got {type(raw).__name__}")
        role = _role_of(raw, where)
        content = _content_of(raw, where)
        name = raw.get("name")
        if name is not None and not isinstance(name, str):
            raise KimiInputError(f"{where}.name must be a string")
        if role == "assistant":
            reasoning = raw.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise KimiInputError(f"{where}.reasoning_content must be a string or null")
            calls = _tool_calls_of(raw.get("tool_calls"), where, call_counter)
            call_counter += len(calls)
            unanswered = [call.id for call in calls]
            messages.append(Message(role, content, name, reasoning or "", tuple(calls), None))
        elif role == "tool":
            call_id = raw.get("tool_call_id")
            if call_id is None:
                if not unanswered:
                    raise KimiInputError(f"{where} is a tool result with no tool_call_id and no pending tool call")
                call_id = unanswered[0]
            if not isinstance(call_id, str):
                raise KimiInputError(f"{where}.tool_call_id must be a string")
            if call_id in unanswered:
                unanswered.remove(call_id)
            messages.append(Message(role, content, name, tool_call_id=call_id))
        else:
            messages.append(Message(role, content, name))

    tools = _tools_of(record.get("tools"))
    extra = {k: v for k, v in record.items() if k not in ("messages", "conversations", "tools")}
    if source == "conversations":
        extra.pop("system", None)
    return Conversation(tuple(messages), tools, extra)


def conversation_to_openai(conversation: Conversation) -> dict[str, Any]:
    """The conversation as an OpenAI ``{"messages": [...], "tools": [...]}`` record.

    Assistant turns carry ``reasoning_content`` (always, possibly empty) so that a round trip and
    a request to an OpenAI-compatible server keep the reasoning. Extra keys of the source record
    are kept.
    """
    messages = []
    for message in conversation.messages:
        item: dict[str, Any] = {"role": message.role}
        item["content"] = message.content if isinstance(message.content, str) else [dict(p) for p in message.content]
        if message.name is not None:
            item["name"] = message.name
        if message.role == "assistant":
            item["reasoning_content"] = message.reasoning
            if message.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in message.tool_calls
                ]
        if message.role == "tool":
            item["tool_call_id"] = message.tool_call_id
        messages.append(item)
    record: dict[str, Any] = dict(conversation.extra)
    record["messages"] = messages
    if conversation.tools:
        record["tools"] = [dict(tool) for tool in conversation.tools]
    return record


def _role_of(raw: Mapping[str, Any], where: str) -> Role:
    if "role" in raw:
        role = raw["role"]
        allowed: Mapping[str, Role] = {r: r for r in ("system", "user", "assistant", "tool")}
    elif "from" in raw:
        role = raw["from"]
        allowed = _SHAREGPT_ROLES
    else:
        raise KimiInputError(f"{where} has neither 'role' nor 'from'")
    if not isinstance(role, str) or role not in allowed:
        raise KimiInputError(f"{where} has unsupported role {role!r} (expected one of {', '.join(allowed)})")
    return allowed[role]


def _content_of(raw: Mapping[str, Any], where: str) -> str | tuple[Mapping[str, Any], ...]:
    content = raw["content"] if "content" in raw else raw.get("value")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise KimiInputError(f"{where}.content must be a string, null or a list of parts")
    parts = []
    for number, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise KimiInputError(f"{where}.content[{number}] must be an object with a 'type'")
        kind = part["type"]
        if kind in _TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                raise KimiInputError(f"{where}.content[{number}] is a text part without 'text'")
        elif kind not in _MEDIA_PART_TYPES:
            raise KimiInputError(f"{where}.content[{number}] has unsupported part type {kind!r}")
        parts.append(part)
    return tuple(parts)


def _tool_calls_of(raw_calls: Any, where: str, first_index: int) -> list[ToolCall]:
    if raw_calls is None:
        return []
    if isinstance(raw_calls, str):
        try:
            raw_calls = json.loads(raw_calls)
        except json.JSONDecodeError as exc:
            raise KimiInputError(f"{where}.tool_calls is a string that is not JSON: {exc}") from exc
    if not isinstance(raw_calls, list):
        raise KimiInputError(f"{where}.tool_calls must be a list")
    calls = []
    for number, raw in enumerate(raw_calls):
        at = f"{where}.tool_calls[{number}]"
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(function, dict):
            raise KimiInputError(f"{at} must be an object with a 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise KimiInputError(f"{at}.function.name must be a non-empty string")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise KimiInputError(f"{at}.function.arguments must be a string or an object")
        call_id = raw.get("id") or f"functions.{name}:{first_index + number}"
        if not isinstance(call_id, str):
            raise KimiInputError(f"{at}.id must be a string")
        calls.append(ToolCall(call_id, name, arguments))
    return calls


def _tools_of(raw_tools: Any) -> tuple[dict[str, Any], ...]:
    if raw_tools is None or raw_tools == "":
        return ()
    if isinstance(raw_tools, str):
        try:
            raw_tools = json.loads(raw_tools)
        except json.JSONDecodeError as exc:
            raise KimiInputError(f"'tools' is a string that is not JSON: {exc}") from exc
    if not isinstance(raw_tools, Sequence) or isinstance(raw_tools, (str, bytes)):
        raise KimiInputError("'tools' must be a list of tool objects")
    tools = []
    for number, tool in enumerate(raw_tools):
        if not isinstance(tool, dict):
            raise KimiInputError(f"tools[{number}] must be an object")
        if "type" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        tools.append(tool)
    return tuple(tools)
