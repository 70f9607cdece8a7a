"""``specforge-kimi target-text``: greedy text of a tiny target and the entropy along it, on CPU.

Checks the batched, left-padded generation against a plain argmax loop, the entropy against a
direct computation, that a sharper copy of a target is ranked first, that the selection prompts
are neither the bench's nor the training corpus's, and the bad-input errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMALL = dict(
    layers=2,
    hidden=64,
    heads=4,
    experts=4,
    experts_per_token=2,
    moe_intermediate=32,
    dense_intermediate=64,
    q_lora_rank=32,
    vision_hidden=32,
    vision_heads=4,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from specforge_kimi.demo.pretrain import pretrain_structured_target
    from specforge_kimi.targets.tiny import TinySpec

    out = tmp_path_factory.mktemp("target-text") / "t"
    pretrain_structured_target(
        out, TinySpec(**SMALL), seconds=300, max_steps=30, progress=False, heldout=4, conversations=200
    )
    return out


def _model_and_tok(target):
    from transformers import AutoTokenizer

    from specforge_kimi.targets.checkpoint import load_text_model

    return load_text_model(str(target)).eval(), AutoTokenizer.from_pretrained(str(target))


def test_greedy_continue_and_entropy_match_direct_computation(target):
    import torch

    from specforge_kimi.demo.target_text import greedy_continue, selection_prompts, text_stats

    model, tok = _model_and_tok(target)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    groups = selection_prompts(tok, corpus_prompts=2, mix_prompts=2)
    prompts = groups["corpus"] + groups["prompt_mix"]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    cont = greedy_continue(model, prompts, max_new_tokens=6, eos_id=eos, batch=3)
    ent, n = 0.0, 0
    with torch.no_grad():
        for p, c in zip(prompts, cont, strict=False):
            seq = list(p)
            for _ in range(6):  # plain greedy loop, no cache, no padding
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                logp = torch.log_softmax(logits, -1)
                ent += float(-(logp.exp() * logp).sum())
                n += 1
                seq.append(int(logits.argmax()))
                if seq[-1] == eos:
                    break
            assert c == seq[len(p) :]
    st = text_stats(model, prompts, cont, eos_id=eos)
    assert st["generated_tokens"] == n and st["mean_entropy"] == pytest.approx(ent / n, rel=1e-4)


def test_sharper_copy_is_chosen(target, tmp_path):
    """Scaling the output head by 8 sharpens every next-token distribution (same argmax, so the same
    greedy text): its entropy is lower, and the command names it."""
    import shutil

    from safetensors.torch import load_file, save_file

    sharp = tmp_path / "sharp"
    shutil.copytree(target, sharp)
    for f in sharp.glob("*.safetensors"):
        state = load_file(f)
        keys = [k for k in state if k.endswith("lm_head.weight")]
        for k in keys:
            state[k] = state[k] * 8
        if keys:
            save_file(state, f, metadata={"format": "pt"})
    out = tmp_path / "select.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specforge_kimi",
            "target-text",
            str(target),
            str(sharp),
            "--device",
            "cpu",
            "--corpus-prompts",
            "3",
            "--mix-prompts",
            "3",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(out.read_text())
    a, b = summary["candidates"]
    assert b["mean_entropy"] < a["mean_entropy"], (a["mean_entropy"], b["mean_entropy"])
    assert summary["chosen"] == str(sharp) and f"chosen: {sharp}" in res.stdout
    assert set(a["groups"]) == {"corpus", "prompt_mix"} and a["pretrain"]["steps"] == 30


def test_selection_prompts_are_distinct_and_not_bench_prompts(target):
    """Distinct, and none is a prompt the bench sends (its structured set is the corpus's seed-20000
    conversations, asked as their prompt part; chat/math/code with thinking on)."""
    from specforge_kimi.data import corpus
    from specforge_kimi.data.chat_template import encode_records as _rows
    from specforge_kimi.data.corpus import HELDOUT_SEED
    from specforge_kimi.demo.target_text import selection_prompts
    from specforge_kimi.evaluate.bench import builtin_prompt_set, encode_prompt

    _, tok = _model_and_tok(target)
    sel = selection_prompts(tok, corpus_prompts=48, mix_prompts=48)
    chosen = {tuple(p) for ps in sel.values() for p in ps}
    bench = {tuple(ids[: mask.index(1)]) for ids, mask in _rows(list(corpus.conversations(48, seed=HELDOUT_SEED)), tok)}
    for name in ("chat", "math", "code"):
        bench |= {tuple(encode_prompt(p, tok, thinking=True)) for p in builtin_prompt_set(name).prompts}
    assert len(sel["corpus"]) == len(sel["prompt_mix"]) == 48 and len(chosen) == 96
    assert not chosen & bench


def test_bad_input(tmp_path, tiny_dir):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "specforge_kimi", "target-text", *args], capture_output=True, text=True
        )

    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / "tokenizer_config.json").unlink()
    res = run(str(bare), "--device", "cpu")
    assert res.returncode != 0 and "has no tokenizer" in res.stderr, res.stderr[-2000:]
    res = run(str(tiny_dir), "--corpus-prompts", "0", "--mix-prompts", "0")
    assert res.returncode != 0 and "at least one selection prompt" in res.stderr
