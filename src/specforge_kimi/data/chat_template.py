"""The ``kimi-k2.5`` chat template: K2.5's rendering, the training text, and its loss mask.

:func:`render_messages` renders exactly what K2.5's published ``chat_template.jinja`` renders
(with the ``tools_ts_str`` its tokenizer class supplies): ``<|im_system|>`` / ``<|im_user|>`` /
``<|im_assistant|>`` + name + ``<|im_middle|>`` + body + ``<|im_end|>``, no newline between
turns, tool declarations first (TypeScript-like, :mod:`specforge_kimi.data.tool_declaration`), tool
calls ``<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
<|tool_call_end|>...<|tool_calls_section_end|>``, tool results ``<|im_system|>NAME<|im_middle|>
## Return of ID\\nCONTENT<|im_end|>``. No default system prompt is injected (K2 and K2-Thinking
injected one; K2.5 does not), so a conversation without a system turn starts at its first turn.

Reasoning: every assistant turn up to and including the last assistant turn without tool calls
renders ``<think></think>`` (reasoning dropped); later turns (an agentic tool-call chain still in
progress) keep ``<think>REASONING</think>``; ``thinking=False`` blanks all of them. One
deliberate difference: ``reasoning_content: null`` renders as empty; the Jinja template would
print the text ``None``.

Training text (:func:`training_spans`) is NOT the full-conversation render: the full render blanks
the final answer's reasoning, while the target generated it. The training row for an assistant
turn T is what the target saw and produced at T: the render of the turns before T plus K2.5's
generation prompt (``<|im_assistant|>assistant<|im_middle|><think>``, or ``<think></think>`` in
instant mode), then the generated ``REASONING</think>CONTENT[TOOL CALLS]<|im_end|>``. Which turns
are trained (loss mask 1 on exactly the generated tokens, 0 on everything else):

- thinking mode: T and the tool-calling assistant turns between the previous final answer and T.
  Their text in the row is exactly what the target generated, after exactly the prompt it saw
  (the template keeps reasoning in an unfinished tool chain). Earlier assistant turns are context
  only: the row shows them with reasoning removed, which is not what the target generated.
- instant mode (no reasoning): every earlier assistant turn without reasoning is trained too:
  ``thinking=False`` renders all turns the same way at every step, so each one is again exactly
  the target's output after its own prompt.

By default a conversation gives one row, T = its last assistant turn; ``one_row_per_answer``
gives one row per final answer (each earlier answer's reasoning trained in its own row, at the
cost of repeating the prefix). The mode is per row: thinking if a trained-candidate turn has
reasoning, else instant, unless forced.

SpecForge's generic template machinery cannot express this (its parsers find assistant spans by
regex in ``tokenizer.apply_chat_template`` output, which drops the reasoning the target
generated), so :func:`register_template` registers a ``kimi-k2.5`` entry whose ``parser_type``
SpecForge's raw-conversation path rejects loudly, and which names this module's renderer. The
working path is ``specforge-kimi prepare`` -> pre-tokenized ``data.prompts_path``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from specforge_kimi.data.conversation import Conversation, Message, conversation_from_record
from specforge_kimi.data.tokenizer import TextTokenizer
from specforge_kimi.data.tool_declaration import render_tool_declaration

__all__ = [
    "TEMPLATE_NAME",
    "Span",
    "answer_turns",
    "encode_records",
    "encode_spans",
    "generation_prompt",
    "register_template",
    "render_messages",
    "training_rows",
    "training_spans",
]

TEMPLATE_NAME = "kimi-k2.5"

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
IMAGE_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>\n"


@dataclass(frozen=True)
class Span:
    """A piece of rendered text and whether the target generated it (loss mask 1)."""

    text: str
    trained: bool = False


def generation_prompt(*, thinking: bool = True) -> str:
    """K2.5's generation prompt: the assistant header then ``<think>`` or ``<think></think>``."""
    think = THINK_OPEN if thinking else THINK_OPEN + THINK_CLOSE
    return f"{IM_ASSISTANT}assistant{IM_MIDDLE}{think}"


def render_messages(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    thinking: bool = True,
    add_generation_prompt: bool = False,
) -> str:
    """Render like K2.5's chat template (``apply_chat_template(..., tokenize=False)``)."""
    spans = _render_spans(
        messages,
        tools,
        thinking=thinking,
        history_end=_last_answer(messages, len(messages)),
        trained=frozenset(),
    )
    text = "".join(span.text for span in spans)
    return text + generation_prompt(thinking=thinking) if add_generation_prompt else text


def answer_turns(conversation: Conversation, *, one_row_per_answer: bool = False) -> list[int]:
    """Indices of the assistant turns that end a training row (see the module docstring)."""
    assistants = conversation.assistant_indices
    if not assistants:
        return []
    if not one_row_per_answer:
        return [assistants[-1]]
    ends = [i for i in assistants if not conversation.messages[i].tool_calls]
    if assistants[-1] not in ends:
        ends.append(assistants[-1])
    return ends


def training_spans(
    conversation: Conversation,
    end: int,
    *,
    thinking: bool | None = None,
    train_earlier_instant_turns: bool = True,
) -> list[Span]:
    """The training row that ends at assistant turn ``end``, as text spans with loss flags.

    ``thinking=None`` picks the mode from the data (thinking if a candidate turn has
    reasoning). ``train_earlier_instant_turns`` (instant mode only) also trains the assistant
    turns before the previous final answer; :func:`training_rows` turns it off when each answer
    gets its own row.
    """
    messages = conversation.messages[: end + 1]
    if not messages or messages[-1].role != "assistant":
        raise ValueError(f"turn {end} is not an assistant turn")
    history_end = _last_answer(messages, end)
    segment = [j for j in range(history_end + 1, end + 1) if messages[j].role == "assistant"]
    if thinking is None:
        thinking = any(messages[j].reasoning for j in segment)
    if thinking:
        trained = frozenset(segment)
    else:
        pool = range(end + 1) if train_earlier_instant_turns else segment
        trained = frozenset(j for j in pool if messages[j].role == "assistant" and not messages[j].reasoning)
    return _render_spans(
        messages,
        conversation.tools,
        thinking=thinking,
        history_end=history_end,
        trained=trained,
        prompted_turn=end,
    )


def training_rows(
    conversation: Conversation,
    *,
    thinking: bool | None = None,
    one_row_per_answer: bool = False,
) -> list[list[Span]]:
    """All training rows of a conversation (one by default); empty if it has no assistant turn."""
    return [
        training_spans(
            conversation,
            end,
            thinking=thinking,
            train_earlier_instant_turns=not one_row_per_answer,
        )
        for end in answer_turns(conversation, one_row_per_answer=one_row_per_answer)
    ]


def encode_spans(spans: Sequence[Span], tokenizer: TextTokenizer) -> tuple[list[int], list[int]]:
    """Token ids and the per-token loss mask of a span list.

    Spans are encoded one run at a time. This equals encoding the joined text because every
    boundary between a trained and an untrained run sits next to a special token (``<think>``,
    ``</think>`` or ``<|im_end|>``), and both K2.5's tiktoken tokenizer and the stand-in split
    special tokens out before encoding the text between them.
    """
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, trained in _merge_runs(spans):
        ids = tokenizer.encode(text)
        input_ids.extend(ids)
        loss_mask.extend([1 if trained else 0] * len(ids))
    return input_ids, loss_mask


def encode_records(records: Sequence[Any], tokenizer: TextTokenizer) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of every training row of OpenAI-format conversation records
    (:func:`training_rows` of each, :func:`encode_spans`)."""
    return [encode_spans(spans, tokenizer) for rec in records for spans in training_rows(conversation_from_record(rec))]


def register_template() -> None:
    """Register ``kimi-k2.5`` in SpecForge's ``TEMPLATE_REGISTRY`` (idempotent).

    The entry carries K2.5's headers and end-of-turn token for anything that reads them, and
    ``parser_type="kimi-k2.5"``, which SpecForge's raw-conversation preprocessing rejects with
    "Invalid parser type": its regex-based parsers would silently train on the wrong text.
    """
    from specforge.data.template import TEMPLATE_REGISTRY

    template = _specforge_template()
    if TEMPLATE_NAME in TEMPLATE_REGISTRY.get_all_template_names():
        existing = TEMPLATE_REGISTRY.get(TEMPLATE_NAME)
        if existing.model_dump() == template.model_dump():
            return
        raise RuntimeError(
            f"SpecForge already has a different chat template named {TEMPLATE_NAME!r}: {existing.model_dump()}"
        )
    TEMPLATE_REGISTRY.register(name=TEMPLATE_NAME, template=template)


@cache
def _specforge_template_class() -> type:
    from specforge.data.template import ChatTemplate

    class KimiK25ChatTemplate(ChatTemplate):
        """SpecForge ChatTemplate for K2.5 that points at our renderer."""

        renderer: str = "specforge_kimi.data.chat_template:training_rows"
        prepare_command: str = "specforge-kimi prepare"

    return KimiK25ChatTemplate


def _specforge_template() -> Any:
    return _specforge_template_class()(
        assistant_header=f"{IM_ASSISTANT}assistant{IM_MIDDLE}",
        user_header=f"{IM_USER}user{IM_MIDDLE}",
        system_prompt=None,
        end_of_turn_token=IM_END,
        parser_type=TEMPLATE_NAME,
        enable_thinking=True,
        ignore_token=None,
    )


def _last_answer(messages: Sequence[Message], stop: int) -> int:
    """Index of the last assistant turn without tool calls before ``stop``, or -1."""
    for index in range(stop - 1, -1, -1):
        message = messages[index]
        if message.role == "assistant" and not message.tool_calls:
            return index
    return -1


def _render_spans(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    history_end: int,
    trained: frozenset[int],
    prompted_turn: int = -1,
) -> list[Span]:
    # ``prompted_turn`` is rendered after K2.5's generation prompt, whose header always says
    # "assistant" (a ``name`` on that message is not what the target saw).
    spans: list[Span] = []
    if tools:
        spans.append(Span(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{render_tool_declaration(tools)}{IM_END}"))
    for index, message in enumerate(messages):
        if message.role == "assistant":
            keep_reasoning = thinking and index > history_end
            label = "assistant" if index == prompted_turn else message.name or "assistant"
            header = f"{IM_ASSISTANT}{label}{IM_MIDDLE}"
            if keep_reasoning:
                prompt = header + THINK_OPEN
                generated = message.reasoning + THINK_CLOSE
            else:
                prompt = header + THINK_OPEN + THINK_CLOSE
                generated = ""
            generated += _content_text(message) + _tool_calls_text(message) + IM_END
            spans.append(Span(prompt))
            spans.append(Span(generated, trained=index in trained))
        elif message.role == "tool":
            header = f"{IM_SYSTEM}{message.name or 'tool'}{IM_MIDDLE}"
            body = f"## Return of {message.tool_call_id}\n{_content_text(message)}"
            spans.append(Span(header + body + IM_END))
        else:
            opener = IM_USER if message.role == "user" else IM_SYSTEM
            header = f"{opener}{message.name or message.role}{IM_MIDDLE}"
            spans.append(Span(header + _content_text(message) + IM_END))
    return spans


def _content_text(message: Message) -> str:
    if isinstance(message.content, str):
        return message.content
    pieces = []
    for part in message.content:
        kind = part.get("type")
        if kind in ("image", "image_url"):
            pieces.append(IMAGE_PLACEHOLDER)
        elif kind in ("video", "video_url"):
            pieces.append(VIDEO_PLACEHOLDER)
        else:
            pieces.append(str(part.get("text", "")))
    return "".join(pieces)


def _tool_calls_text(message: Message) -> str:
    if not message.tool_calls:
        return ""
    calls = []
    for call in message.tool_calls:
        arguments = (
            call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
        )
        calls.append(f"<|tool_call_begin|>{call.id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>")
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def _merge_runs(spans: Sequence[Span]) -> list[tuple[str, bool]]:
    runs: list[tuple[str, bool]] = []
    for span in spans:
        if not span.text:
            continue
        if runs and runs[-1][1] == span.trained:
            runs[-1] = (runs[-1][0] + span.text, span.trained)
        else:
            runs.append((span.text, span.trained))
    return runs
