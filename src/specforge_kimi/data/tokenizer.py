"""K2.5's tokenizer: load it from a checkpoint, assert its special ids, and a stand-in for tests.

K2.5 ships a tiktoken tokenizer as remote code (``tokenization_kimi.TikTokenTokenizer``, no
``tokenizer.json``): 163,584 BPE ranks plus 256 reserved special slots, 163,840 ids in all.
Everything downstream (chat template, loss masks, the draft vocab mapping, SGLang serving) uses
the special ids below, so :func:`load_tokenizer` refuses a tokenizer that maps any of them
elsewhere. Transformers 5 has been reported to shift Kimi special ids by a few positions; this
check is where such a shift stops the run.

The ids come from Moonshot's Kimi tokenizer configs (K2 and K2.5 share them; ``<think>`` /
``</think>`` 163606/163607 as in K2-Thinking) and the K2.5 config (bos 163584, eos 163585,
pad 163839, media placeholder 163605).

The stand-in (:func:`build_standin_tokenizer`) has the same vocab size and the same special
ids, byte-level ids (0..255) for all other text and no merges, so tests and the demo can encode
and decode any text without K2.5's files. It is built in well under a second from nothing and,
saved to a directory, loads with ``transformers.AutoTokenizer`` (no remote code) as well as with
:func:`load_tokenizer`. Token counts with it are bytes, not K2.5 tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from specforge_kimi.errors import KimiInputError

__all__ = [
    "K25_EMITTED_SPECIAL_TOKENS",
    "K25_SPECIAL_TOKENS",
    "K25_VOCAB_SIZE",
    "StandInTokenizer",
    "TextTokenizer",
    "build_standin_tokenizer",
    "check_special_tokens",
    "load_tokenizer",
]

K25_VOCAB_SIZE = 163840
_FIRST_SPECIAL_ID = 163584

K25_SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}

#: Special tokens K2.5 itself generates in an assistant turn (thinking or instant, with or
#: without tool calls). The draft vocabulary must always contain them. ``<think>`` is normally
#: part of the prompt (the generation prompt ends with it) but is kept for prompts that stop at
#: ``<|im_middle|>``; ``[EOS]`` for completions that end on it instead of ``<|im_end|>``.
K25_EMITTED_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
    "[EOS]",
)

_STANDIN_MARKER = "specforge_kimi_standin"


class TextTokenizer(Protocol):
    """What the data path needs from a tokenizer: K2.5's ``encode(text)`` convention.

    ``encode`` takes no keyword arguments: with any, K2.5's tokenizer leaves its tiktoken fast
    path for the generic (slow, warning-logging) one. Special-token text is encoded as the
    special id, as K2.5's ``encode`` does (``allowed_special="all"``).
    """

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table (the byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _special_names() -> dict[int, str]:
    names = {i: f"<|reserved_token_{i}|>" for i in range(_FIRST_SPECIAL_ID, K25_VOCAB_SIZE)}
    for name, token_id in K25_SPECIAL_TOKENS.items():
        names[token_id] = name
    return names


#: A text-only Jinja reduction of K2.5's chat template, saved with the stand-in tokenizer so an
#: SGLang server can serve a tiny target's chat endpoint (``regenerate`` against a real server).
#: Covers system/user/assistant text turns (history assistant turns render ``<think></think>``,
#: as K2.5's template renders every turn up to the last answer) and the generation prompt with
#: ``thinking`` (default on). Tools and media are out of its scope; ``render_messages`` is the
#: full renderer. Equality with it on text-only conversations is tested.
STANDIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|><think></think>"
    "{{ m['content'] or '' }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


class StandInTokenizer:
    """A byte-level tokenizer with K2.5's vocab size and special ids (tests, demo, CPU runs).

    Backed by a ``tokenizers.Tokenizer`` (BPE, no merges): ids 0..255 are bytes, 256..163583
    are unused placeholders, 163584..163839 are K2.5's specials (named as in K2.5, the unnamed
    ones ``<|reserved_token_ID|>``, K2.5's own naming for empty slots).
    """

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.vocab_size = K25_VOCAB_SIZE
        self.bos_token_id = K25_SPECIAL_TOKENS["[BOS]"]
        self.eos_token_id = K25_SPECIAL_TOKENS["[EOS]"]
        self.pad_token_id = K25_SPECIAL_TOKENS["[PAD]"]

    @classmethod
    def build(cls) -> StandInTokenizer:
        from tokenizers import AddedToken, Tokenizer, decoders, models
        from tokenizers.pre_tokenizers import ByteLevel

        byte_chars = _byte_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        vocab.update({f"<|standin_unused_{i}|>": i for i in range(256, _FIRST_SPECIAL_ID)})
        names = _special_names()
        vocab.update({name: token_id for token_id, name in names.items()})
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(names[i], special=True, normalized=False, lstrip=False, rstrip=False)
                for i in range(_FIRST_SPECIAL_ID, K25_VOCAB_SIZE)
            ]
        )
        return cls(backend)

    @classmethod
    def from_directory(cls, path: str | Path) -> StandInTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(Path(path) / "tokenizer.json")))

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (AutoTokenizer-loadable)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "[BOS]",
            "eos_token": "[EOS]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "model_max_length": 262144,
            "clean_up_tokenization_spaces": False,
            _STANDIN_MARKER: True,
            "chat_template": STANDIN_CHAT_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out


def build_standin_tokenizer(out_dir: str | Path | None = None) -> StandInTokenizer:
    """Build the stand-in tokenizer; with ``out_dir``, also save it there for AutoTokenizer."""
    tokenizer = StandInTokenizer.build()
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load the tokenizer in a local directory and check K2.5's special ids before returning it.

    ``path`` is a K2.5 checkpoint directory (``tokenization_kimi.py``, ``tiktoken.model``,
    ``tokenizer_config.json``; loaded with ``trust_remote_code=True``, nothing fetched) or a
    directory written by :func:`build_standin_tokenizer`.
    """
    directory = Path(path)
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        raise KimiInputError(
            f"{directory} is not a tokenizer directory (no tokenizer_config.json); pass a local "
            "Kimi-K2.5 checkpoint directory or one written by build_standin_tokenizer()"
        )
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise KimiInputError(f"{config_path} is not valid JSON: {exc}") from exc

    if config.get(_STANDIN_MARKER):
        tokenizer: Any = StandInTokenizer.from_directory(directory)
    else:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=True, local_files_only=True)
        except (OSError, ValueError, ImportError) as exc:
            raise KimiInputError(f"cannot load the tokenizer in {directory}: {exc}") from exc
    check_special_tokens(tokenizer, source=str(directory))
    return tokenizer


def check_special_tokens(tokenizer: Any, *, source: str = "tokenizer") -> None:
    """Raise :class:`KimiInputError` unless every K2.5 special token encodes to its own id.

    Checks, for each entry of :data:`K25_SPECIAL_TOKENS`: ``encode(name) == [id]``,
    ``convert_tokens_to_ids(name) == id`` (when the tokenizer has it) and ``decode([id]) ==
    name``; and that the vocabulary has 163,840 ids.
    """
    problems = []
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if vocab_size != K25_VOCAB_SIZE:
        problems.append(f"vocab size {vocab_size}, expected {K25_VOCAB_SIZE}")
    for name, expected in K25_SPECIAL_TOKENS.items():
        encoded = list(tokenizer.encode(name))
        if encoded != [expected]:
            problems.append(f"{name} encodes to {encoded}, expected [{expected}]")
            continue
        convert = getattr(tokenizer, "convert_tokens_to_ids", None)
        if convert is not None and convert(name) != expected:
            problems.append(f"{name} converts to id {convert(name)}, expected {expected}")
        decoded = tokenizer.decode([expected])
        if decoded != name:
            problems.append(f"id {expected} decodes to {decoded!r}, expected {name!r}")
    if problems:
        versions = _library_versions()
        raise KimiInputError(
            f"{source}: K2.5 special token ids do not match ({versions}): "
            + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". The chat template, loss masks and draft vocab mapping assume K2.5's ids; use "
            "K2.5's own tokenizer files with the pinned transformers (5.8.1)."
        )


def _library_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for package in ("transformers", "tiktoken", "tokenizers"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} not installed")
    return ", ".join(parts)
