"""A recipe's input files checked against each other before anything starts: target, tokenizer, prompts,
vocab mapping, lengths.

Scope: read-only, seconds. ``recipe validate --check-files``, ``doctor RECIPE`` and ``launch`` run it;
``launch`` starts nothing when it finds a problem. Each problem is one line naming the file and the fix:

- the target checkpoint exists, is a K2.5 checkpoint, and agrees with the recipe's ``target`` section
  (layers, hidden size, vocab, heads);
- its tokenizer loads and encodes K2.5's special tokens to K2.5's ids;
- ``data.vocab_mapping_path`` exists, is consistent, was built for this target's vocabulary (``t2d``
  covers ``vocab_size`` ids) with K2.5's special-token table, and has the draft's ``draft_vocab_size``;
- ``data.prompts_path`` exists and its first :data:`SAMPLE_ROWS` rows are SpecForge's pre-tokenized form
  (``input_ids`` and ``loss_mask`` of one length) with ids inside the target's vocabulary, rendered with
  K2.5's chat template by this tokenizer (each row holds its ``<|im_assistant|>`` and ``<|im_end|>`` ids);
- ``trainer.max_length`` fits the server's context: the capture server runs with ``--context-length
  max_length + 256`` (``recipes.server_argv``), which SGLang refuses above the target's
  ``max_position_embeddings``; and the draft's ``max_position_embeddings`` covers ``max_length``.
"""

from __future__ import annotations

import json
from pathlib import Path

from specforge_kimi.errors import KimiInputError

SAMPLE_ROWS = 1000
SERVER_CONTEXT_MARGIN = 256  # recipes.server_argv: --context-length max_length + 256


def check_inputs(recipe) -> list[str]:
    """Every problem with ``recipe``'s input files, one line each; ``[]`` when they exist and agree."""
    problems: list[str] = []
    t = recipe.target
    target_vocab = t.vocab_size
    text: dict = {}
    try:
        from specforge_kimi.targets.checkpoint import inspect_target

        info = inspect_target(t.path)
    except KimiInputError as exc:
        problems.append(f"target.path {t.path}: {exc}")
    except OSError as exc:
        problems.append(f"target.path {t.path}: {exc}")
    else:
        text = info.text
        target_vocab = info.vocab_size
        for field, want, got in (
            ("num_layers", t.num_layers, info.num_layers),
            ("hidden_size", t.hidden_size, info.hidden_size),
            ("vocab_size", t.vocab_size, info.vocab_size),
            ("num_attention_heads", t.num_attention_heads, text.get("num_attention_heads")),
        ):
            if want != got:
                problems.append(f"target.{field} is {want} in the recipe but {got} in {t.path}/config.json")
        try:
            from specforge_kimi.data.tokenizer import load_tokenizer

            load_tokenizer(t.path)
        except KimiInputError as exc:
            problems.append(f"target tokenizer: {exc}")
    problems += _vocab_mapping(recipe, target_vocab)
    problems += _prompts(recipe, target_vocab)
    problems += _lengths(recipe, text)
    return problems


def require_inputs(recipe) -> None:
    """:func:`check_inputs`, raising one :class:`KimiInputError` whose lines are the problems."""
    problems = check_inputs(recipe)
    if problems:
        raise KimiInputError("\nerror: ".join(problems))


def _vocab_mapping(recipe, target_vocab: int) -> list[str]:
    from specforge_kimi.data.vocab_mapping import load_vocab_mapping, validate_vocab_mapping

    if recipe.data.vocab_mapping_path is None:  # a block draft: the target's vocabulary, no mapping
        return []
    path = Path(recipe.data.vocab_mapping_path)
    if not path.is_file():
        return [f"data.vocab_mapping_path {path} does not exist (specforge-kimi prepare writes it)"]
    try:
        mapping = load_vocab_mapping(path, validate=False)
        validate_vocab_mapping(mapping, target_vocab_size=target_vocab, source=f"data.vocab_mapping_path {path}")
    except KimiInputError as exc:
        return [str(exc)]
    want = recipe.trainer.draft.draft_vocab_size  # a mapping is EAGLE-3's (data.vocab_mapping_path)
    if mapping.d2t.numel() != want:
        return [
            f"data.vocab_mapping_path {path} maps {mapping.d2t.numel()} draft ids but trainer.draft.draft_vocab_size "
            f"is {want}; prepare again with --draft-vocab-size {want} or fix the draft"
        ]
    return []


def _prompts(recipe, target_vocab: int) -> list[str]:
    from specforge_kimi.data.tokenizer import K25_SPECIAL_TOKENS

    path = Path(recipe.data.prompts_path)
    if not path.is_file():
        return [f"data.prompts_path {path} does not exist (specforge-kimi prepare writes it)"]
    assistant, end = K25_SPECIAL_TOKENS["<|im_assistant|>"], K25_SPECIAL_TOKENS["<|im_end|>"]
    rows = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if rows >= SAMPLE_ROWS:
                break
            if not line.strip():
                continue
            rows += 1
            where = f"data.prompts_path {path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return [f"{where} is not JSON: {exc}"]
            ids, mask = (row.get("input_ids"), row.get("loss_mask")) if isinstance(row, dict) else (None, None)
            if not isinstance(ids, list) or not isinstance(mask, list):
                return [f"{where} lacks input_ids and loss_mask lists: prepare it with specforge-kimi prepare"]
            if len(ids) != len(mask) or not ids:
                return [f"{where} has {len(ids)} input_ids but {len(mask)} loss_mask entries"]
            bad = next((i for i in ids if not isinstance(i, int) or not 0 <= i < target_vocab), None)
            if bad is not None:
                return [
                    f"{where} holds token id {bad}, outside the target's vocabulary of {target_vocab}: it was "
                    "tokenized for another model"
                ]
            if assistant not in ids or end not in ids:
                return [
                    f"{where} has no <|im_assistant|> ({assistant}) or <|im_end|> ({end}) id: it was not rendered "
                    "with K2.5's chat template by this tokenizer; prepare it again with the target's tokenizer"
                ]
    if rows == 0:
        return [f"data.prompts_path {path} is empty"]
    return []


def _lengths(recipe, text: dict) -> list[str]:
    problems = []
    length = recipe.trainer.max_length
    limit = text.get("max_position_embeddings")
    if limit is not None and length + SERVER_CONTEXT_MARGIN > limit:
        problems.append(
            f"trainer.max_length {length} + {SERVER_CONTEXT_MARGIN} exceeds the target's max_position_embeddings "
            f"{limit}: the capture server would refuse its context length; lower trainer.max_length"
        )
    draft = recipe.trainer.draft.max_position_embeddings
    if draft is not None and length > draft:
        problems.append(
            f"trainer.max_length {length} exceeds the draft's max_position_embeddings {draft}; raise it in "
            "trainer.draft or lower trainer.max_length"
        )
    return problems
