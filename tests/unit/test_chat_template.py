"""Golden tests for the kimi-k2.5 template: hand-written expected text, token ids and loss masks.

Expected ids use the stand-in tokenizer: K2.5's special ids, and UTF-8 bytes for other text
(``B("abc")`` is just ``list(b"abc")``, written out where short).
"""

from __future__ import annotations

import pytest

from specforge_kimi.data.chat_template import (
    Span,
    encode_spans,
    generation_prompt,
    render_messages,
    training_rows,
    training_spans,
)
from specforge_kimi.data.conversation import conversation_from_record
from specforge_kimi.data.tool_declaration import render_tool_declaration

BOS, EOS, IM_END, IM_USER, IM_ASSISTANT = 163584, 163585, 163586, 163587, 163588
IM_SYSTEM, IM_MIDDLE, THINK, END_THINK = 163594, 163601, 163606, 163607
SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END = 163595, 163596, 163597, 163598, 163599


def B(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def tok():
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    return build_standin_tokenizer()


def conv(messages, tools=None):
    record = {"messages": messages}
    if tools is not None:
        record["tools"] = tools
    return conversation_from_record(record)


def text_of(spans: list[Span]) -> str:
    return "".join(s.text for s in spans)


def trained_text(spans: list[Span]) -> list[str]:
    return [s.text for s in spans if s.trained]


def only_row(conversation, **kwargs) -> list[Span]:
    rows = training_rows(conversation, **kwargs)
    assert len(rows) == 1
    return rows[0]


# ---------------------------------------------------------------- single turn, thinking

SINGLE_THINKING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add."},
]


def test_single_turn_thinking_full_render_drops_final_reasoning():
    # K2.5's own template: the last assistant turn without tool calls is "history".
    assert render_messages(conv(SINGLE_THINKING).messages) == (
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"
    )


def test_single_turn_thinking_training_text_ids_and_mask(tok):
    row = only_row(conv(SINGLE_THINKING))
    assert text_of(row) == (
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Add.</think>4<|im_end|>"
    )
    assert trained_text(row) == ["Add.</think>4<|im_end|>"]
    ids, mask = encode_spans(row, tok)
    assert ids == [
        IM_USER, 117, 115, 101, 114, IM_MIDDLE,
        87, 104, 97, 116, 32, 105, 115, 32, 50, 43, 50, 63, IM_END,
        IM_ASSISTANT, 97, 115, 115, 105, 115, 116, 97, 110, 116, IM_MIDDLE, THINK,
        65, 100, 100, 46, END_THINK, 52, IM_END,
    ]  # fmt: skip
    assert mask == [0] * 31 + [1] * 7


def test_generation_prompts():
    assert generation_prompt() == "<|im_assistant|>assistant<|im_middle|><think>"
    assert generation_prompt(thinking=False) == "<|im_assistant|>assistant<|im_middle|><think></think>"
    prompt = render_messages(conv(SINGLE_THINKING).messages[:1], add_generation_prompt=True)
    assert prompt == "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"


# ---------------------------------------------------------------- single turn, instant

SINGLE_INSTANT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
]


def test_single_turn_instant_text_ids_and_mask(tok):
    row = only_row(conv(SINGLE_INSTANT))
    assert text_of(row) == (
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>hello<|im_end|>"
    )
    # instant mode: <think></think> is part of the prompt, the target generates the rest
    assert trained_text(row) == ["hello<|im_end|>"]
    ids, mask = encode_spans(row, tok)
    assert ids == [
        IM_USER, *B("user"), IM_MIDDLE, 104, 105, IM_END,
        IM_ASSISTANT, *B("assistant"), IM_MIDDLE, THINK, END_THINK,
        104, 101, 108, 108, 111, IM_END,
    ]  # fmt: skip
    assert mask == [0] * 22 + [1] * 6


def test_forced_thinking_trains_the_close_tag(tok):
    row = only_row(conv(SINGLE_INSTANT), thinking=True)
    assert text_of(row).endswith("<|im_middle|><think></think>hello<|im_end|>")
    assert trained_text(row) == ["</think>hello<|im_end|>"]
    ids, mask = encode_spans(row, tok)
    assert ids[-8:] == [THINK, END_THINK, *B("hello"), IM_END]
    assert mask[-8:] == [0, 1, 1, 1, 1, 1, 1, 1]


def test_forced_instant_drops_reasoning(tok):
    row = only_row(conv(SINGLE_THINKING), thinking=False)
    assert text_of(row).endswith("<|im_middle|><think></think>4<|im_end|>")
    # the turn had reasoning: in instant mode it is context, not trained
    assert trained_text(row) == []


# ---------------------------------------------------------------- multi-turn, reasoning history

MULTI = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye!", "reasoning_content": "Say bye."},
]


def test_multi_turn_full_render_blanks_all_reasoning():
    assert render_messages(conv(MULTI).messages) == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Goodbye!<|im_end|>"
    )


def test_multi_turn_trains_last_answer_with_history_reasoning_dropped(tok):
    row = only_row(conv(MULTI))
    assert text_of(row) == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Say bye.</think>Goodbye!<|im_end|>"
    )
    assert trained_text(row) == ["Say bye.</think>Goodbye!<|im_end|>"]
    ids, mask = encode_spans(row, tok)
    expected_ids = (
        [IM_USER, *B("user"), IM_MIDDLE, *B("Hi"), IM_END]
        + [IM_ASSISTANT, *B("assistant"), IM_MIDDLE, THINK, END_THINK, *B("Hello!"), IM_END]
        + [IM_USER, *B("user"), IM_MIDDLE, *B("Bye"), IM_END]
        + [IM_ASSISTANT, *B("assistant"), IM_MIDDLE, THINK]
        + [*B("Say bye."), END_THINK, *B("Goodbye!"), IM_END]
    )
    assert ids == expected_ids
    trained = 8 + 1 + 8 + 1
    assert mask == [0] * (len(expected_ids) - trained) + [1] * trained


def test_multi_turn_one_row_per_answer(tok):
    rows = training_rows(conv(MULTI), one_row_per_answer=True)
    assert len(rows) == 2
    assert text_of(rows[0]) == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Greet back.</think>Hello!<|im_end|>"
    )
    assert trained_text(rows[0]) == ["Greet back.</think>Hello!<|im_end|>"]
    assert trained_text(rows[1]) == ["Say bye.</think>Goodbye!<|im_end|>"]


def test_multi_turn_instant_trains_every_answer(tok):
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in MULTI]
    row = only_row(conv(messages))
    assert trained_text(row) == ["Hello!<|im_end|>", "Goodbye!<|im_end|>"]
    ids, mask = encode_spans(row, tok)
    first = ids.index(IM_ASSISTANT)
    assert ids[first : first + 20] == [
        IM_ASSISTANT,
        *B("assistant"),
        IM_MIDDLE,
        THINK,
        END_THINK,
        *B("Hello!"),
        IM_END,
    ]
    assert mask[first : first + 20] == [0] * 13 + [1] * 7


# ---------------------------------------------------------------- tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "city": {"type": "string"},
                },
                "required": ["city"],
            },
        },
    }
]
TOOLS_TS = (
    "# Tools\n\n## functions\nnamespace functions {\n// Get the weather.\n"
    'type get_weather = (_: {\n  city: string,\n  unit?: "c" | "f"\n}) => any;\n}\n'
)
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"},
    {"role": "assistant", "content": "18C in Paris.", "reasoning_content": "Report."},
]  # fmt: skip
CALL_TEXT = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_tool_declaration_is_typescript():
    assert render_tool_declaration(TOOLS) == TOOLS_TS


def test_tool_declaration_falls_back_to_compact_json_like_k25():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"oneOf": [{"type": "string"}]}},
                },
            },
        }
    ]
    assert render_tool_declaration(tools) == (
        '[{"function":{"name":"f","parameters":{"properties":{"x":{"oneOf":[{"type":"string"}]}},'
        '"type":"object"}},"type":"function"}]'
    )


def test_tool_full_render():
    assert render_messages(conv(TOOL_CHAT, TOOLS).messages, conv(TOOL_CHAT, TOOLS).tools) == (
        f"<|im_system|>tool_declare<|im_middle|>{TOOLS_TS}<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think></think>{CALL_TEXT}<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>18C in Paris.<|im_end|>"
    )


def test_tool_chain_in_progress_keeps_reasoning_in_full_render():
    messages = conv(TOOL_CHAT[:3]).messages
    assert render_messages(messages).endswith(
        f"<|im_assistant|>assistant<|im_middle|><think>Need the tool.</think>{CALL_TEXT}<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
    )


def test_tool_training_row_text_ids_and_mask(tok):
    row = only_row(conv(TOOL_CHAT, TOOLS))
    assert text_of(row) == (
        f"<|im_system|>tool_declare<|im_middle|>{TOOLS_TS}<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think>Need the tool.</think>{CALL_TEXT}<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Report.</think>18C in Paris.<|im_end|>"
    )
    assert trained_text(row) == [
        f"Need the tool.</think>{CALL_TEXT}<|im_end|>",
        "Report.</think>18C in Paris.<|im_end|>",
    ]
    ids, mask = encode_spans(row, tok)
    call_ids = [
        *B("Need the tool."), END_THINK,
        SECTION_BEGIN, CALL_BEGIN, *B("functions.get_weather:0"), ARG_BEGIN,
        *B('{"city": "Paris"}'), CALL_END, SECTION_END, IM_END,
    ]  # fmt: skip
    expected = (
        [IM_SYSTEM, *B("tool_declare"), IM_MIDDLE, *B(TOOLS_TS), IM_END]
        + [IM_USER, *B("user"), IM_MIDDLE, *B("Weather in Paris?"), IM_END]
        + [IM_ASSISTANT, *B("assistant"), IM_MIDDLE, THINK]
        + call_ids
        + [
            IM_SYSTEM,
            *B("tool"),
            IM_MIDDLE,
            *B("## Return of functions.get_weather:0\n18C"),
            IM_END,
        ]
        + [IM_ASSISTANT, *B("assistant"), IM_MIDDLE, THINK]
        + [*B("Report."), END_THINK, *B("18C in Paris."), IM_END]
    )
    assert ids == expected
    start_call = expected.index(THINK) + 1
    tool_result = start_call + len(call_ids)
    start_answer = len(expected) - (7 + 1 + 13 + 1)
    assert mask == (
        [0] * start_call
        + [1] * len(call_ids)
        + [0] * (start_answer - tool_result)
        + [1] * (len(expected) - start_answer)
    )


def test_dict_arguments_use_jinja_tojson_separators():
    messages = [dict(m) for m in TOOL_CHAT[:2]]
    messages[1] = {
        **messages[1],
        "tool_calls": [
            {
                "id": "functions.f:0",
                "type": "function",
                "function": {"name": "f", "arguments": {"a": "é", "b": [1, 2]}},
            }
        ],
    }
    assert render_messages(conv(messages).messages).endswith(
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": "é", "b": [1, 2]}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    )


def test_missing_tool_call_id_and_result_id_are_filled():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "r"},
    ]
    c = conv(messages)
    assert c.messages[1].tool_calls[0].id == "functions.f:0"
    assert c.messages[2].tool_call_id == "functions.f:0"


# ---------------------------------------------------------------- system prompt


def test_no_default_system_prompt_is_injected(tok):
    row = only_row(conv(SINGLE_INSTANT))
    ids, _ = encode_spans(row, tok)
    assert ids[0] == IM_USER
    assert IM_SYSTEM not in ids
    assert render_messages(conv(SINGLE_INSTANT).messages).startswith("<|im_user|>user<|im_middle|>hi")


def test_present_system_prompt(tok):
    messages = [{"role": "system", "content": "You are terse."}, *SINGLE_INSTANT]
    row = only_row(conv(messages))
    assert text_of(row) == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>hello<|im_end|>"
    )
    ids, mask = encode_spans(row, tok)
    assert ids[:23] == [IM_SYSTEM, *B("system"), IM_MIDDLE, *B("You are terse."), IM_END]
    assert mask[:23] == [0] * 23
    assert trained_text(row) == ["hello<|im_end|>"]


# ---------------------------------------------------------------- formats, media, invariants


def test_sharegpt_matches_openai(tok):
    sharegpt = conversation_from_record(
        {
            "system": "S",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
        }
    )
    openai = conv([{"role": "system", "content": "S"}, *SINGLE_INSTANT])
    assert encode_spans(only_row(sharegpt), tok) == encode_spans(only_row(openai), tok)


def test_media_parts_render_like_k25():
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "video", "video": "v"},
        ]},
        {"role": "assistant", "content": "ok"},
    ]  # fmt: skip
    c = conv(messages)
    assert c.has_media
    assert render_messages(c.messages).startswith(
        "<|im_user|>user<|im_middle|>see<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
        "<|kimi_k25_video_placeholder|>\n<|im_end|>"
    )


def test_null_reasoning_renders_empty_not_none():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": None},
    ]
    assert "None" not in text_of(only_row(conv(messages), thinking=True))


@pytest.mark.parametrize("case", [SINGLE_THINKING, SINGLE_INSTANT, MULTI, TOOL_CHAT])
def test_span_encoding_equals_whole_text_encoding(tok, case):
    for row in training_rows(conv(case, TOOLS), one_row_per_answer=True):
        ids, mask = encode_spans(row, tok)
        assert ids == tok.encode(text_of(row))
        assert len(mask) == len(ids)
        # the mask is exactly the tokens of the trained spans
        assert [i for i, m in zip(ids, mask, strict=True) if m] == tok.encode("".join(trained_text(row)))


def test_training_spans_rejects_non_assistant_end():
    with pytest.raises(ValueError):
        training_spans(conv(SINGLE_INSTANT), 0)


def test_register_template_is_idempotent():
    from specforge.data.template import TEMPLATE_REGISTRY

    from specforge_kimi.data.chat_template import register_template

    register_template()
    register_template()
    template = TEMPLATE_REGISTRY.get("kimi-k2.5")
    assert template.assistant_header == "<|im_assistant|>assistant<|im_middle|>"
    assert template.user_header == "<|im_user|>user<|im_middle|>"
    assert template.end_of_turn_token == "<|im_end|>"
    assert template.system_prompt is None
    assert template.parser_type == "kimi-k2.5"
    assert template.renderer == "specforge_kimi.data.chat_template:training_rows"


def test_specforge_raw_path_refuses_the_template_loudly():
    from specforge.data.preprocessing import preprocess_conversations
    from specforge.data.template import TEMPLATE_REGISTRY

    from specforge_kimi.data.chat_template import register_template

    register_template()
    with pytest.raises(ValueError, match="Invalid parser type"):
        preprocess_conversations(None, [SINGLE_INSTANT], TEMPLATE_REGISTRY.get("kimi-k2.5"), tools=[[]])
