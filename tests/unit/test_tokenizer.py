"""K2.5 special ids, the special-id check, and the stand-in tokenizer."""

from __future__ import annotations

import json
import time

import pytest

from specforge_kimi.data.tokenizer import (
    K25_EMITTED_SPECIAL_TOKENS,
    K25_SPECIAL_TOKENS,
    K25_VOCAB_SIZE,
    build_standin_tokenizer,
    check_special_tokens,
    load_tokenizer,
)
from specforge_kimi.errors import KimiInputError


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("standin")
    build_standin_tokenizer(out)
    return out


def test_special_ids_are_k25s():
    # K2.5 config: bos, eos, chat markers, media, pad; think ids as in Kimi's config.
    assert K25_SPECIAL_TOKENS["[BOS]"] == 163584
    assert K25_SPECIAL_TOKENS["[EOS]"] == 163585
    assert K25_SPECIAL_TOKENS["<|im_end|>"] == 163586
    assert K25_SPECIAL_TOKENS["<|im_user|>"] == 163587
    assert K25_SPECIAL_TOKENS["<|im_assistant|>"] == 163588
    assert K25_SPECIAL_TOKENS["<|im_system|>"] == 163594
    assert K25_SPECIAL_TOKENS["<|im_middle|>"] == 163601
    assert K25_SPECIAL_TOKENS["<|media_pad|>"] == 163605
    assert K25_SPECIAL_TOKENS["<think>"] == 163606
    assert K25_SPECIAL_TOKENS["</think>"] == 163607
    assert [K25_SPECIAL_TOKENS[n] for n in (
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    )] == [163595, 163596, 163597, 163598, 163599]  # fmt: skip
    assert K25_SPECIAL_TOKENS["[PAD]"] == 163839
    assert set(K25_EMITTED_SPECIAL_TOKENS) <= set(K25_SPECIAL_TOKENS)


def test_standin_is_cheap_and_has_k25_layout():
    started = time.monotonic()
    tok = build_standin_tokenizer()
    assert time.monotonic() - started < 5
    assert tok.vocab_size == K25_VOCAB_SIZE == len(tok)
    check_special_tokens(tok)
    assert tok.encode("<|reserved_token_163600|>") == [163600]


def test_standin_encodes_any_text_as_bytes_plus_specials():
    tok = build_standin_tokenizer()
    text = "Grüße, 世界!\n\t<think>x</think><|im_end|>[EOS] \x00"
    ids = tok.encode(text)
    assert ids == [
        *"Grüße, 世界!\n\t".encode(), 163606, 120, 163607, 163586, 163585, 32, 0,
    ]  # fmt: skip
    assert tok.decode(ids) == text
    # special-looking text that is not a K2.5 special stays bytes
    assert tok.encode("<|im_start|>") == list(b"<|im_start|>")


def test_standin_build_is_deterministic(tmp_path):
    build_standin_tokenizer(tmp_path / "a")
    build_standin_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_load_tokenizer_checks_standin_dir(standin_dir):
    tok = load_tokenizer(standin_dir)
    assert tok.encode("hi<|im_end|>") == [104, 105, 163586]


def test_standin_dir_loads_with_autotokenizer_and_passes_check(standin_dir, tmp_path):
    # Without our marker the directory goes through transformers.AutoTokenizer, the path a
    # real K2.5 checkpoint takes (trust_remote_code, local files only).
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((standin_dir / "tokenizer.json").read_bytes())
    config = json.loads((standin_dir / "tokenizer_config.json").read_text())
    config.pop("specforge_kimi_standin")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(plain)
    assert type(tok).__module__.startswith("transformers")
    assert tok.encode("hi<|im_end|>") == [104, 105, 163586]


def test_shifted_special_ids_stop_with_a_clear_error(standin_dir, tmp_path):
    # The reported transformers-5 failure mode: specials land on other ids.
    shifted = tmp_path / "shifted"
    shifted.mkdir()
    data = json.loads((standin_dir / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["content"] == "<think>":
            entry["content"] = "</think>"
        elif entry["content"] == "</think>":
            entry["content"] = "<think>"
    vocab = data["model"]["vocab"]
    vocab["<think>"], vocab["</think>"] = vocab["</think>"], vocab["<think>"]
    (shifted / "tokenizer.json").write_text(json.dumps(data))
    (shifted / "tokenizer_config.json").write_text((standin_dir / "tokenizer_config.json").read_text())
    with pytest.raises(KimiInputError, match=r"<think> encodes to \[163607\], expected \[163606\]") as info:
        load_tokenizer(shifted)
    assert "transformers" in str(info.value)


def test_wrong_vocab_size_is_reported():
    class Small:
        vocab_size = 151936

        def encode(self, text):
            return [K25_SPECIAL_TOKENS.get(text, 0)]

        def decode(self, ids):
            return {v: k for k, v in K25_SPECIAL_TOKENS.items()}[ids[0]]

    with pytest.raises(KimiInputError, match="vocab size 151936, expected 163840"):
        check_special_tokens(Small())


def test_not_a_tokenizer_dir(tmp_path):
    with pytest.raises(KimiInputError, match="not a tokenizer directory"):
        load_tokenizer(tmp_path)


def test_standin_chat_template_matches_renderer(tmp_path):
    """The Jinja saved with the stand-in renders text-only conversations exactly like render_messages."""
    from transformers import AutoTokenizer

    from specforge_kimi.data.chat_template import render_messages
    from specforge_kimi.data.conversation import conversation_from_record
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    build_standin_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    convs = [
        [{"role": "user", "content": "Count from 1 to 3."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
            {"role": "user", "content": "again"},
        ],
    ]
    for msgs in convs:
        for thinking in (True, False):
            ours = render_messages(
                conversation_from_record({"messages": msgs}).messages, thinking=thinking, add_generation_prompt=True
            )
            theirs = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, thinking=thinking)
            assert theirs == ours
