"""`specforge-kimi bench` on CPU: arguments, prompt sets, metrics from SGLang 0.5.14 responses,
the server lifecycle against a stand-in process at the HTTP boundary, the result JSON, the report.

The real engine is exercised by ``tests/gpu/test_bench_sglang.py``. Here the responses carry
exactly the ``meta_info`` keys SGLang 0.5.14 writes for a finished speculative request
(``tokenizer_manager.py`` ``_calculate_spec_decoding_metrics``: ``spec_accept_rate``,
``spec_accept_length``, ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``,
``spec_verify_ct``, the aliases ``spec_accepted_drafts``/``spec_proposed_drafts``,
``spec_correct_drafts_histogram`` and its alias ``spec_accept_histogram``), with the values its
scheduler would count.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from specforge_kimi.errors import KimiInputError
from specforge_kimi.evaluate import bench
from specforge_kimi.evaluate.bench import BenchSettings, SpecConfig

REPO = Path(__file__).resolve().parents[2]


def _meta(hist: list[int], *, draft_tokens: int = 4, prompt_tokens: int = 20) -> dict:
    """meta_info of a finished EAGLE request as SGLang 0.5.14 builds it from its counters.

    One token comes from prefill; each verify step emits its accepted drafts + the bonus token.
    """
    verify = sum(hist)
    correct = sum(k * c for k, c in enumerate(hist))
    completion = 1 + correct + verify
    proposed = verify * (draft_tokens - 1)
    return {
        "id": "x",
        "finish_reason": {"type": "length", "length": completion},
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": completion,
        "cached_tokens": 0,
        "e2e_latency": completion / 100,
        "spec_accept_rate": correct / proposed,
        "spec_accept_length": completion / verify,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": verify,
        "spec_accepted_drafts": correct,
        "spec_proposed_drafts": proposed,
        "spec_correct_drafts_histogram": hist,
        "spec_accept_histogram": hist,
    }


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def test_spec_configs_parse_and_refuse_what_sglang_would_rewrite():
    assert bench.parse_spec_config("3,1,4") == SpecConfig(3, 1, 4)
    assert bench.parse_spec_config("7/1/8").label == "7/1/8"
    assert bench.parse_spec_config("5,4,8") == SpecConfig(5, 4, 8)  # a tree: topk 4
    with pytest.raises(KimiInputError, match="draft tokens = steps \\+ 1"):
        bench.parse_spec_config("3,1,5")  # SGLang would silently serve 3/1/4
    for bad in ("3,1", "a,b,c", "0,1,1", "2,2,40"):
        with pytest.raises(KimiInputError):
            bench.parse_spec_config(bad)


def _dirs(tmp_path: Path, *, target_ctx: int = 262144, draft_ctx: int = 4096) -> tuple[Path, Path]:
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "model_type": "kimi_k25",
                "text_config": {"max_position_embeddings": target_ctx},
                "specforge_kimi_tiny": {"layers": 8, "hidden": 64},
            }
        )
    )
    (draft / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "max_position_embeddings": draft_ctx,
                "draft_vocab_size": 49,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
            }
        )
    )
    return target, draft


def test_settings_validation(tmp_path):
    target, draft = _dirs(tmp_path)
    BenchSettings(target=str(target), draft=str(draft)).validate()
    cases = [
        ({"target": str(tmp_path / "nope")}, "no config.json"),
        ({"concurrency": 0}, "--concurrency"),
        ({"tp": 0}, "--tp"),
        ({"min_acceptance_length": 0.5}, "can never fail"),
        ({"mem_fraction_static": 1.5}, "mem-fraction"),
        ({"configs": []}, "no speculative config"),
        ({"num_prompts": 0}, "--num-prompts"),
    ]
    for kw, msg in cases:
        s = BenchSettings(**{"target": str(target), "draft": str(draft), **kw})
        with pytest.raises(KimiInputError, match=msg):
            s.validate()


def test_cli_bad_input_is_one_error_line(tmp_path, capsys):
    from specforge_kimi.cli import main

    target, draft = _dirs(tmp_path)
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--config", "3,1,5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "3/1/5" in err[0]
    assert main(["bench", "--draft", str(draft)]) == 2
    assert "--target" in capsys.readouterr().err


def test_context_length_defaults_to_what_the_draft_allows(tmp_path):
    target, draft = _dirs(tmp_path)
    s = BenchSettings(target=str(target), draft=str(draft), max_new_tokens=256)
    # SGLang gives the draft the target's context and refuses one longer than the draft's own
    assert bench.context_length(s, 100) == 4096
    s.context_length = 300
    with pytest.raises(KimiInputError, match="cannot hold"):
        bench.context_length(s, 100)


def test_server_argv_is_text_only_launcher_without_capture(tmp_path):
    target, draft = _dirs(tmp_path)
    s = BenchSettings(
        target=str(target), draft=str(draft), tp=2, disable_cuda_graph=True, extra_server_args=["--log-level", "info"]
    )
    base = bench.server_argv(s, None, port=31000, context=4096, python="python")
    spec = bench.server_argv(s, SpecConfig(7, 1, 8), port=31000, context=4096, python="python")
    assert base[:3] == ["python", "-m", "specforge_kimi.capture_server"]
    for argv in (base, spec):
        joined = " ".join(argv)
        assert "--skip-tokenizer-init" in argv and "--enable-spec-capture" not in argv
        assert "--host 127.0.0.1" in joined and "--attention-backend triton" in joined and "--tp-size 2" in joined
        assert "--context-length 4096" in joined and "--mem-fraction-static" not in joined
        assert argv[-2:] == ["--log-level", "info"]
    assert not any(a.startswith("--speculative") for a in base)
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert spec[spec.index("--speculative-draft-model-path") + 1] == str(draft)
    assert [
        spec[spec.index(f) + 1]
        for f in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
    ] == ["7", "1", "8"]
    # identical apart from speculation, so the speedup compares like with like
    k = len(base) - 2
    assert spec[:k] + spec[-2:] == base
    assert spec[k:-2] == ["--speculative-draft-model-path", str(draft), *SpecConfig(7, 1, 8).argv()]
    s.mem_fraction_static = 0.3
    assert "--mem-fraction-static" in bench.server_argv(s, None, port=1, context=4096)


def test_server_argv_sizes_cuda_graphs_to_the_bench(tmp_path):
    """With CUDA graphs on, both servers capture decode graphs up to --concurrency and no prefill graph; with
    --disable-cuda-graph neither flag; --server-arg comes after and overrides."""
    target, draft = _dirs(tmp_path)
    s = BenchSettings(
        target=str(target), draft=str(draft), concurrency=3, extra_server_args=["--cuda-graph-max-bs-decode=8"]
    )
    for spec in (None, SpecConfig(3, 1, 4)):
        argv = bench.server_argv(s, spec, port=1, context=4096, python="python")
        assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "3"
        assert "--disable-prefill-cuda-graph" in argv and "--disable-cuda-graph" not in argv
        assert argv[-1] == "--cuda-graph-max-bs-decode=8"
    s.disable_cuda_graph = True
    argv = bench.server_argv(s, None, port=1, context=4096, python="python")
    assert "--disable-cuda-graph" in argv and "--cuda-graph-max-bs-decode" not in argv
    assert "--disable-prefill-cuda-graph" not in argv


@pytest.mark.slow
def test_cuda_graph_flags_parse_with_sglangs_own_parser(tmp_path):
    """The CUDA graph flags exist in SGLang 0.5.14 and land where meant (imports sglang: ~10 s)."""
    from specforge_kimi.servers.capture_server import parse_text_only_args

    target, draft = _dirs(tmp_path)
    s = BenchSettings(target=str(target), draft=str(draft), concurrency=2)
    ns = parse_text_only_args(bench.server_argv(s, SpecConfig(3, 1, 4), port=30001, context=4096)[3:])
    assert (ns.cuda_graph_max_bs_decode, ns.disable_prefill_cuda_graph, ns.disable_cuda_graph) == (2, True, False)


@pytest.mark.slow
def test_server_argv_parses_with_sglangs_own_parser_through_our_launcher(tmp_path):
    """Every flag exists in SGLang 0.5.14 and lands where meant (imports sglang: ~10 s)."""
    from specforge_kimi.servers.capture_server import parse_text_only_args

    target, draft = _dirs(tmp_path)
    s = BenchSettings(
        target=str(target),
        draft=str(draft),
        mem_fraction_static=0.3,
        disable_cuda_graph=True,
        disable_allreduce_fusion=True,
    )
    ns = parse_text_only_args(bench.server_argv(s, SpecConfig(3, 1, 4), port=30001, context=4096)[3:])
    assert (
        ns.speculative_algorithm,
        ns.speculative_draft_model_path,
        ns.speculative_num_steps,
        ns.speculative_eagle_topk,
        ns.speculative_num_draft_tokens,
    ) == ("EAGLE3", str(draft), 3, 1, 4)
    assert ns.skip_tokenizer_init and ns.enable_multimodal is False and ns.context_length == 4096
    assert (ns.attention_backend, ns.mem_fraction_static, ns.host, ns.port) == ("triton", 0.3, "127.0.0.1", 30001)
    assert ns.enforce_disable_flashinfer_allreduce_fusion and not getattr(ns, "enable_spec_capture", False)


# ---------------------------------------------------------------------------------------------
# prompt sets
# ---------------------------------------------------------------------------------------------
def test_builtin_sets_are_package_data_and_encode_to_k25_generation_prompts():
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "data/prompts/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["specforge_kimi"]
    tok = build_standin_tokenizer()
    for name in ("chat", "math", "code"):
        ps = bench.builtin_prompt_set(name)
        assert len(ps.prompts) >= 24 and len({p.id for p in ps.prompts}) == len(ps.prompts)
        assert all(p.messages[-1].role == "user" for p in ps.prompts)
    ids = bench.encode_prompt(bench.builtin_prompt_set("math").prompts[0], tok, thinking=True)
    assert tok.decode(ids).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert tok.decode(bench.encode_prompt(bench.builtin_prompt_set("math").prompts[0], tok, thinking=False)).endswith(
        "<think></think>"
    )
    structured = bench.builtin_prompt_set("structured")
    assert len(structured.prompts) == bench.STRUCTURED_PROMPTS
    assert {p.thinking for p in structured.prompts} == {True, False}  # each keeps its conversation's mode
    assert [p.id for p in structured.prompts] == [p.id for p in bench.structured_prompt_set().prompts]
    with pytest.raises(KimiInputError, match="unknown prompt set"):
        bench.builtin_prompt_set("poetry")


def test_user_jsonl_prompt_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps(
                    {
                        "id": "a",
                        "messages": [
                            {"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "reference, dropped"},
                        ],
                    }
                ),
                "",
                json.dumps({"prompt": "Count to 3.", "thinking": False}),
            ]
        )
        + "\n"
    )
    ps = bench.load_prompt_file(f)
    assert ps.name == "mine" and [p.id for p in ps.prompts] == ["a", "mine-3"]
    assert [m.role for m in ps.prompts[0].messages] == ["system", "user"]
    assert ps.prompts[1].thinking is False and ps.prompts[1].messages[0].content == "Count to 3."
    sets = bench.load_prompt_sets(["code"], [str(f)], limit=1)
    assert [s.name for s in sets] == ["code", "mine"] and all(len(s.prompts) == 1 for s in sets)


@pytest.mark.parametrize(
    "lines, msg",
    [
        (['{"prompt": "ok"}', '{"prompt": "unterminated'], ":2: not valid JSON"),
        (['{"text": "hi"}'], ":1: record has neither"),
        (['{"messages": [{"role": "assistant", "content": "only an answer"}]}'], ":1: the prompt must end with a user"),
        (['{"prompt": ""}'], ":1: 'prompt' must be a non-empty string"),
        (['{"prompt": "x", "thinking": "yes"}'], ":1: 'thinking' must be true or false"),
        (["", "  "], "holds no prompts"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, lines, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(KimiInputError, match=msg) as exc:
        bench.load_prompt_file(f)
    assert str(f) in str(exc.value)


def test_prompt_set_names_must_be_unique(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text('{"prompt": "hi"}\n')
    with pytest.raises(KimiInputError, match="two prompt sets are named 'chat'"):
        bench.load_prompt_sets(["chat"], [str(f)])
    with pytest.raises(KimiInputError, match="not found"):
        bench.load_prompt_sets([], [str(tmp_path / "missing.jsonl")])


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------
def test_metrics_from_sglang_meta_info():
    a, b = _meta([1, 2, 0, 1]), _meta([0, 0, 1, 2])  # 10 tokens / 4 verifies; 12 tokens / 3 verifies
    short = {
        "id": "s",
        "finish_reason": {"type": "stop", "matched": 163586},
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "cached_tokens": 0,
        "e2e_latency": 0.01,
    }  # no verify step: no spec keys
    m = bench.summarize(
        [{"id": "p0", "meta_info": a}, {"id": "p1", "meta_info": b}, {"id": "p2", "meta_info": short}],
        wall_s=2.0,
        spec=SpecConfig(3, 1, 4),
    )
    assert (m["completion_tokens"], m["spec_verify_ct"], m["spec_num_correct_drafts"]) == (23, 7, 13)
    assert m["per_request"] == [
        {"id": "p0", "completion_tokens": 10, "spec_verify_ct": 4},
        {"id": "p1", "completion_tokens": 12, "spec_verify_ct": 3},
        {"id": "p2", "completion_tokens": 1, "spec_verify_ct": 0},
    ]
    assert m["acceptance_length"] == pytest.approx(23 / 7)
    assert m["acceptance_length_decode"] == pytest.approx(20 / 7)
    assert m["acceptance_length_mean_per_request"] == pytest.approx((10 / 4 + 12 / 3) / 2)
    assert m["accept_rate"] == pytest.approx(13 / 21)
    assert m["correct_drafts_histogram"] == [1, 2, 1, 3] and m["histogram_consistent"]
    assert m["per_position"]["at_least"] == pytest.approx([6 / 7, 4 / 7, 3 / 7])
    assert m["per_position"]["conditional"] == pytest.approx([6 / 7, 2 / 3, 3 / 4])
    assert m["requests_without_verify"] == 1 and m["finish_reasons"] == {"length": 2, "stop": 1}
    assert m["output_tok_per_s"] == pytest.approx(11.5)
    base = bench.summarize([{"meta_info": short}], wall_s=0.5, spec=None)
    assert "acceptance_length" not in base and base["output_tok_per_s"] == pytest.approx(2.0)
    # an inconsistent histogram is flagged, not trusted
    bad = dict(a, spec_correct_drafts_histogram=[4])
    assert not bench.summarize([{"meta_info": bad}], wall_s=1, spec=SpecConfig(3, 1, 4))["histogram_consistent"]


def test_per_position_pads_short_histograms():
    assert bench.per_position_acceptance([], 3) == {"at_least": [], "conditional": []}
    pp = bench.per_position_acceptance([2, 2], 3)  # nothing ever accepted position 2 or 3
    assert pp["at_least"] == [0.5, 0.0, 0.0] and pp["conditional"] == [0.5, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# the whole run against a stand-in server process (HTTP boundary)
# ---------------------------------------------------------------------------------------------
FAKE_SERVER = textwrap.dedent('''
    """Stand-in for SGLang 0.5.14's HTTP server: /health, /generate (ids in, ids out), /flush_cache,
    /server_info; speculative meta_info built from a deterministic acceptance pattern."""
    import argparse, json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-num-steps", type=int); p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-dflash-block-size", type=int)
    args, _ = p.parse_known_args()
    if args.speculative_algorithm == "DFLASH":  # SGLang's _handle_dflash: B draft tokens, B-1 drafted positions
        args.speculative_num_draft_tokens = args.speculative_dflash_block_size
        args.speculative_num_steps = args.speculative_dflash_block_size - 1
    if os.environ.get("FAKE_EXIT"):
        print("fake server: failing at start", flush=True); sys.exit(int(os.environ["FAKE_EXIT"]))
    open(os.environ["FAKE_PIDS"], "a").write(f"{os.getpid()}\\n")
    PATTERN = [2, 0, 3, 1]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def _send(self, obj):
            body = json.dumps(obj).encode(); self.send_response(200)
            self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
        def do_GET(self):
            if self.path == "/server_info":
                return self._send({"internal_states": [{"avg_spec_accept_length": 2.5}]})
            return self._send({})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                return self._send({})
            ids, sp = req["input_ids"], req["sampling_params"]
            assert sp["temperature"] == 0.0 and sp["stop_token_ids"] == [163586, 163585]
            n = min(sp["max_new_tokens"], 5 + len(ids) % 7)
            out = [(sum(ids) + i) % 256 for i in range(n)]
            meta = {"id": "r", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ids),
                    "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                    "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.001 * n}
            if args.speculative_algorithm:
                steps, hist, made, verify, correct, i = args.speculative_num_steps, [], 1, 0, 0, 0
                while made < n:
                    k = min(PATTERN[i % 4], steps); i += 1
                    hist.extend([0] * (k + 1 - len(hist))); hist[k] += 1
                    verify += 1; correct += k; made += k + 1
                proposed = verify * (args.speculative_num_draft_tokens - 1)
                meta.update({"spec_accept_rate": correct / proposed, "spec_accept_length": n / verify,
                             "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                             "spec_verify_ct": verify, "spec_accepted_drafts": correct,
                             "spec_proposed_drafts": proposed, "spec_correct_drafts_histogram": hist,
                             "spec_accept_histogram": hist})
                with open(os.environ["FAKE_REQUESTS"], "a") as f:  # what this server answered, in order
                    f.write(json.dumps({"steps": steps, "n": n, "verify": verify, "correct": correct}) + "\\n")
            self._send({"output_ids": out, "meta_info": meta})
    ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE_SERVER)
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("FAKE_REQUESTS", str(tmp_path / "requests.jsonl"))
    return [sys.executable, str(script)]


def test_run_bench_end_to_end_against_a_stand_in_server(tmp_path, fake_server):
    target, draft = _dirs(tmp_path)
    out = tmp_path / "out"
    s = BenchSettings(
        target=str(target),
        draft=str(draft),
        sets=["math", "structured"],
        num_prompts=4,
        max_new_tokens=64,
        concurrency=2,
        warmup=1,
        standin_tokenizer=True,
        check_draft=False,
        min_acceptance_length=2.0,
        threshold_sets=["structured"],
        start_timeout_s=60,
        out_dir=str(out),
    )
    result = bench.run_bench(s, launcher=fake_server)
    on_disk = json.loads((out / "bench_result.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert (out / "acceptance.png").stat().st_size > 10_000
    for key in (
        "benchmark",
        "schema_version",
        "date_utc",
        "command",
        "environment",
        "target",
        "draft",
        "tokenizer",
        "settings",
        "context_length",
        "prompt_sets",
        "baseline",
        "speculative",
        "threshold",
        "png",
        "metric_definitions",
        "wall_s",
    ):
        assert key in result, key
    assert result["benchmark"] == "acceptance" and result["context_length"] == 4096
    assert result["prompt_sets"]["math"]["prompts"] == 4 and result["prompt_sets"]["structured"]["prompts"] == 4
    assert [r["config"] for r in result["speculative"]] == [
        {"steps": 3, "topk": 1, "draft_tokens": 4},
        {"steps": 7, "topk": 1, "draft_tokens": 8},
    ]
    assert not any(a.startswith("--speculative") for a in result["baseline"]["server_argv"])
    # what each speculative server answered (the stand-in's own record), its first request the warmup
    answered: dict[int, list[dict]] = {}
    for line in (tmp_path / "requests.jsonl").read_text().splitlines():
        row = json.loads(line)
        answered.setdefault(row["steps"], []).append(row)
    for run in result["speculative"]:
        timed = answered[run["config"]["steps"]][s.warmup :]
        assert len(timed) == 8  # 4 prompts in each of the two sets
        n, verify = sum(r["n"] for r in timed), sum(r["verify"] for r in timed)
        assert run["overall"]["completion_tokens"] == n and run["overall"]["spec_verify_ct"] == verify
        assert run["overall"]["acceptance_length"] == pytest.approx(n / verify)
        assert sum(m["completion_tokens"] for m in run["sets"].values()) == n
        assert sum(m["spec_num_correct_drafts"] for m in run["sets"].values()) == sum(r["correct"] for r in timed)
        for name, m in run["sets"].items():
            assert m["requests"] == 4 and m["histogram_consistent"]
            # 5..11 tokens a request, 2,0,3,1 drafts accepted in turn: 2.0 (6 tokens in 3 verifies) to 3.0 (9 in 3)
            assert 2.0 <= m["acceptance_length"] <= 3.0
            assert len(m["per_position"]["at_least"]) == run["config"]["steps"]
            assert run["speedup"][name] is not None
            assert run["output_match"][name] == {"identical": 4, "different": 0, "first_different": []}
        assert run["server_info_avg_spec_accept_length"] == 2.5
        assert set(run["speedup"]) == {"math", "structured", "overall"}
    # the fake accepts 2,0,3,1 drafts in turn (capped at steps): a 3-step chain never accepts more than 3
    assert max(len(r["overall"]["correct_drafts_histogram"]) for r in result["speculative"]) == 4
    th = result["threshold"]
    assert th["sets"] == ["structured"] and th["config"] == {"steps": 3, "topk": 1, "draft_tokens": 4}
    first = result["speculative"][0]["sets"]["structured"]
    assert th["acceptance_length"] == pytest.approx(first["acceptance_length"])
    assert th["passed"] is True  # no request of the stand-in accepts below 2.0, the minimum set above
    assert {p.name for p in (out / "logs").iterdir()} == {"baseline.log", "eagle3-3-1-4.log", "eagle3-7-1-8.log"}
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3 and not any(Path(f"/proc/{p}").exists() for p in pids)  # every server torn down (reaped)
    failing = bench.check_threshold(result, 99.0)
    assert failing["passed"] is False


def test_server_that_dies_at_start_fails_with_its_log(tmp_path, fake_server, monkeypatch):
    target, draft = _dirs(tmp_path)
    monkeypatch.setenv("FAKE_EXIT", "3")
    s = BenchSettings(
        target=str(target),
        draft=str(draft),
        sets=["math"],
        num_prompts=1,
        standin_tokenizer=True,
        check_draft=False,
        start_timeout_s=30,
        out_dir=str(tmp_path / "out"),
    )
    with pytest.raises(RuntimeError, match="(?s)exited.*failing at start"):
        bench.run_bench(s, launcher=fake_server)


def _recipe_on(tmp_path: Path, name: str, target: Path) -> tuple[dict, Path]:
    """A shipped recipe's YAML with its target at ``target`` and its output under ``tmp_path``: (raw, path)."""
    import yaml

    raw = yaml.safe_load((REPO / "recipes" / name).read_text())
    raw["target"]["path"] = str(target)
    raw["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return raw, path


def test_recipe_settings(tmp_path):
    import yaml

    from specforge_kimi.plan.run_plan import load_recipe

    target, draft = _dirs(tmp_path)
    raw, path = _recipe_on(tmp_path, "tiny-k25-tp2-h200x2.yaml", target)
    recipe = load_recipe(path)
    s = bench.recipe_settings(recipe, draft)
    assert s.configs == [SpecConfig(recipe.bench.steps, recipe.bench.topk, recipe.bench.draft_tokens)]
    assert s.min_acceptance_length == recipe.bench.min_acceptance_length
    assert s.sets == ["structured"] and s.standin_tokenizer  # tiny target without tokenizer files
    assert (s.tp, s.attention_backend, s.disable_allreduce_fusion) == (2, "triton", True)
    assert s.out_dir == str(tmp_path / "run" / "bench")
    s.validate()
    # the bench decodes with CUDA graphs although the capture server (which never decodes) runs without them
    assert recipe.server.disable_cuda_graph and not s.disable_cuda_graph
    raw["bench"]["cuda_graph"] = False
    path.write_text(yaml.safe_dump(raw))
    assert bench.recipe_settings(load_recipe(path), draft).disable_cuda_graph


def _recipe_bench_args(tmp_path: Path):
    """A parse function for ``bench --recipe R --draft D ...`` on the tiny recipe, whose server has an extra arg."""
    import yaml

    target, draft = _dirs(tmp_path)
    raw, path = _recipe_on(tmp_path, "tiny-k25-tp1-h200.yaml", target)
    raw["server"]["extra_args"] = ["--log-level", "info"]
    path.write_text(yaml.safe_dump(raw))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return lambda *flags: parser.parse_args(["--recipe", str(path), "--draft", str(draft), *flags])


def test_every_bench_flag_is_honored_or_refused_beside_a_recipe():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    dests = {a.dest for a in parser._actions} - {"help", "draft", "recipe"}
    run, fixed = set(bench.RECIPE_RUN_FLAGS), set(bench.RECIPE_FIXED_FLAGS)
    assert not run & fixed and run | fixed == dests
    assert set(bench.FLAG_FIELDS) == dests - {"target", "config"}


def test_recipe_bench_honors_the_flags_about_how_to_run(tmp_path):
    from dataclasses import asdict

    parse = _recipe_bench_args(tmp_path)
    (tmp_path / "mine.jsonl").write_text('{"prompt": "hi"}\n')
    base = bench.settings_from_args(parse())
    assert base.sets == ["structured"] and base.extra_server_args == ["--log-level", "info"]
    cases = [
        (["--num-prompts", "3"], "num_prompts", 3),
        (["--out", str(tmp_path / "o")], "out_dir", str(tmp_path / "o")),
        (["--disable-cuda-graph"], "disable_cuda_graph", True),
        (["--no-baseline"], "baseline", False),
        (["--baseline-from", str(tmp_path / "e")], "baseline_from", str(tmp_path / "e")),
        (["--max-new-tokens", "64"], "max_new_tokens", 64),
        (["--concurrency", "4"], "concurrency", 4),
        (["--warmup", "0"], "warmup", 0),
        (["--no-thinking"], "thinking", False),
        (["--context-length", "2048"], "context_length", 2048),
        (["--port", "31234"], "port", 31234),
        (["--start-timeout", "60"], "start_timeout_s", 60.0),
        (["--request-timeout", "30"], "request_timeout_s", 30.0),
        (["--skip-draft-check"], "check_draft", False),
        (["--server-arg=--enable-metrics"], "extra_server_args", ["--log-level", "info", "--enable-metrics"]),
        (["--sets", "chat,math"], "sets", ["chat", "math"]),
        (["--sets", ""], "sets", []),
        (["--sets", ",".join(bench.BUILTIN_SETS)], "sets", list(bench.BUILTIN_SETS)),  # all, as typed
        (["--prompts-file", str(tmp_path / "mine.jsonl")], "prompt_files", [str(tmp_path / "mine.jsonl")]),
    ]
    for flags, name, want in cases:
        s = asdict(bench.settings_from_args(parse(*flags)))
        assert s[name] == want != asdict(base)[name], flags
        assert {k: v for k, v in s.items() if k != name} == {k: v for k, v in asdict(base).items() if k != name}


@pytest.mark.parametrize(
    "flags,section",
    [
        (["--target", "elsewhere"], "target section sets the target checkpoint"),
        (["--config", "7,1,8"], "bench section sets the speculative config"),
        (["--tp", "2"], "gpus section sets the TP size"),
        (["--attention-backend", "flashinfer"], "server section sets the attention backend"),
        (["--mem-fraction-static", "0.5"], "server section sets the static memory fraction"),
        (["--disable-allreduce-fusion"], "server section sets allreduce fusion"),
        (["--tokenizer", "tok"], "target section sets the tokenizer"),
        (["--standin-tokenizer"], "target section sets the tokenizer"),
        (["--min-acceptance-length", "1.5"], "bench section sets the threshold"),
        (["--threshold-sets", "chat"], "bench section sets the threshold"),
    ],
)
def test_recipe_bench_refuses_the_flags_the_recipe_fixes(tmp_path, flags, section):
    parse = _recipe_bench_args(tmp_path)
    with pytest.raises(KimiInputError) as exc:
        bench.settings_from_args(parse(*flags, "--num-prompts", "2"))
    msg = str(exc.value)
    assert msg.startswith(f"{flags[0]} does not apply with --recipe: the recipe's {section}") and "\n" not in msg


def test_recipe_bench_names_every_refused_flag_at_once(tmp_path):
    parse = _recipe_bench_args(tmp_path)
    with pytest.raises(KimiInputError, match=r"^--config, --tp do not apply with --recipe: .*bench.*; .*gpus"):
        bench.settings_from_args(parse("--config", "7,1,8", "--tp", "2", "--no-baseline"))


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _report_module():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_from_sample_results(tmp_path):
    report = _report_module()
    results = tmp_path / "results"
    results.mkdir()
    for name in ("prepare_memory.json", "capture_parity_h200x2.json"):
        (results / name).write_text((REPO / "bench" / "results" / name).read_text())
    hist_a, hist_b = [1, 2, 0, 1], [0, 0, 1, 2]
    run = {
        "label": "eagle3-3-1-4",
        "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
        "server_argv": [],
        "startup_s": 60.0,
        "server_info_avg_spec_accept_length": 2.8,
        "sets": {
            "structured": bench.summarize(
                [{"meta_info": _meta(hist_a)}, {"meta_info": _meta(hist_b)}], wall_s=1.0, spec=SpecConfig(3, 1, 4)
            )
        },
        "speedup": {"structured": 1.7, "overall": 1.7},
        "output_match": {"structured": {"identical": 2, "different": 0, "first_different": []}},
    }
    run["overall"] = run["sets"]["structured"]
    sample = {
        "benchmark": "acceptance",
        "schema_version": 1,
        "date_utc": "2026-12-01T00:00:00Z",
        "target": {"path": "/x/tiny", "tiny_spec": {"layers": 8, "hidden": 512}, "pretrain": {"train": {"steps": 600}}},
        "draft": {"path": "/x/export-sglang", "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 49},
        "settings": {"max_new_tokens": 64, "concurrency": 1, "tp": 1, "attention_backend": "triton"},
        "baseline": {"sets": {"structured": {"output_tok_per_s": 100.0}}},
        "speculative": [run],
        "threshold": {
            "min_acceptance_length": 3.0,
            "sets": ["structured"],
            "acceptance_length": 23 / 7,
            "passed": True,
            "config": run["config"],
        },
    }
    (results / "acceptance_tiny.json").write_text(json.dumps(sample))
    (results / "notes.json").write_text('{"something": "else"}')
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert md == (tmp_path / "REPORT.md").read_text()
    assert (
        "| acceptance_tiny.json | tiny 8L/512h, pretrained 600 steps | 3/1/4 | structured | 2 | 3.143 | 2.857 "
        "| 0.619 | 0.86 / 0.57 / 0.43 | 22.0 | 100.0 | 1.70x | 2/2 |"
    ) in md
    assert "**passed**" in md
    for title in ("## Capture overhead", "## Pipeline efficiency", "## Trainer memory"):
        section = md.split(title, 1)[1].split("\n## ", 1)[0]
        assert "Not measured yet" in section, title
    assert "## Regenerate against SGLang\n\nNot measured yet" in md
    assert "| 60000 | 100.8 | yes | 699.3 | 142.6 | 91.3 |" in md
    assert "tp1_fusion-off | passed | 111 | 0.99996" in md
    assert "`notes.json`" in md.split("## Unrecognised results files", 1)[1]
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "acceptance.png",
        "capture_parity.png",
        "prepare_memory.png",
    }
    # bench/online_pipeline.py output fills capture overhead, pipeline efficiency and trainer memory
    online = {
        "command": ["python", "bench/online_pipeline.py"],
        "engine": "sglang",
        "baseline_capture_over_plain": {"tp1": {"64x1024": 0.55}},
        "runs": [
            {
                "tp": 1,
                "shapes": [
                    {
                        "batch": 64,
                        "tokens_per_prompt": 1024,
                        "plain_tokens_per_s": 400000.0,
                        "capture_tokens_per_s": 300000.0,
                        "capture_over_plain": 0.75,
                        "feature_bytes_per_token": 8192.0,
                        "capture_write_gb_per_s": 2.5,
                        "read_gb_per_s": 4.0,
                        "in_flight": {
                            "in_flight": 2,
                            "plain_tokens_per_s": 500000.0,
                            "capture_tokens_per_s": 450000.0,
                            "capture_over_plain": 0.9,
                        },
                    }
                ],
            },
            {"tp": 2, "error": "RuntimeError: boom"},
        ],
        "online_run": {
            "source": "/r/online_run.json",
            "perf": {
                "end_to_end_tokens_per_s": 900.0,
                "trainer_only_tokens_per_s": 1200.0,
                "data_wait_fraction": 0.25,
                "steps_used": 190,
            },
            "slowest_stage": "trainer_only_tokens_per_s",
            "end_to_end_over_slowest_stage": 0.75,
            "gpu_memory": {"peak_mib_per_role": {"capture-server": 40000, "trainer": 9000}},
        },
    }
    (results / "online_pipeline_h200x2.json").write_text(json.dumps(online))
    (results / "online_pipeline_dry.json").write_text(json.dumps({**online, "engine": "reference"}))
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    sec = {
        t: md.split(f"## {t}", 1)[1].split("\n## ", 1)[0]
        for t in ("Capture overhead", "Pipeline efficiency", "Trainer memory")
    }
    assert "| tp1 | 64x1024 | 400000 | 300000 | 0.75x | 0.55x | 8192 | 2.50 | 4.00 |" in sec["Capture overhead"]
    assert "| tp1 | 64x1024, 2 in flight | 500000 | 450000 | 0.90x | - | - | - | - |" in sec["Capture overhead"]
    assert "error: RuntimeError: boom" in sec["Capture overhead"]
    assert "| end-to-end / slowest stage | 0.750 |" in sec["Pipeline efficiency"]
    assert "| trainer | 9000 |" in sec["Trainer memory"]
    assert all("`online_pipeline_dry.json` is a CPU dry run" in v for v in sec.values())
    # a planned kind shows its rows once a file exists
    (results / "trainer_memory.json").write_text(
        json.dumps({"benchmark": "trainer_memory", "command": "x", "rows": [{"rank": 0, "peak_gib": 7.5}]})
    )
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert "| rank | peak_gib |" in md.split("## Trainer memory", 1)[1].split("\n## ", 1)[0]


def test_report_tabulates_targets_runs_evaluations_drills(tmp_path):
    """The committed GPU and CPU results other than the bench's are recognised and tabulated."""
    report = _report_module()
    results = tmp_path / "results"
    results.mkdir()
    for name in (
        "tiny_target_pretrain_120s_h200x2.json",
        "online_run_regen_h200x2.json",
        "online_run_regen_h200x2_eval_draft.json",
        "fault_drills_h200x2.json",
        "mla_vs_llama_cpu.json",
        "draft_logits_parity_h200.json",
        "offline_twin_tp1_h200.json",
        "mla_vs_llama_engine_tp1_h200.json",
        "pretrain_repro_h200.json",
        "online_run_mix_tp1_h200_eval_draft.json",
        "mooncake_put_cpu.json",
        "passthrough_cpu.json",
        "online_pipeline_tp1_h200_breakdown.json",
        "offline_twin_echo_tp1_h200.json",
        "bench_sglang_test_untrained_tp1_h200.json",
        "teacher_memory_cpu.json",
        "trainer_memory_k25_b200_h200.json",
        "trainer_step_loss_curve_k25_b200_h200.json",
    ):
        (results / name).write_text((REPO / "bench" / "results" / name).read_text())
    greedy = {
        "benchmark": "EAGLE-3 draft acceptance on the tiny target's own greedy text, by pretraining loss and "
        "draft-vocab padding (CPU)",
        "settings": {"steps": 300, "pretrain_steps": 150},
        "configs": [
            {
                "target_loss": "full",
                "draft_vocab_size": 49,
                "decode_round_acceptance_length": 3.1,
                "decode_round_at_least": [0.9, 0.7, 0.5],
                "every_position_acceptance_length": 3.2,
                "teacher_entropy": 1.0,
                "heldout_loss": 1.2,
                "train_acc_per_position_last": [0.9, 0.8],
            }
        ],
    }
    (results / "greedy.json").write_text(json.dumps(greedy))
    select = {
        "command": ["specforge-kimi", "target-text"],
        "chosen": "b",
        "candidates": [
            {
                "target": "a",
                "mean_entropy": 2.1,
                "mean_top1_probability": 0.5,
                "pretrain": {"seed": 0, "steps": 2000},
                "groups": {"corpus": {"mean_entropy": 1.9}, "prompt_mix": {"mean_entropy": 2.3}},
            },
            {
                "target": "b",
                "mean_entropy": 1.7,
                "mean_top1_probability": 0.6,
                "pretrain": {"seed": 1, "steps": 2000},
                "groups": {"corpus": {"mean_entropy": 1.5}, "prompt_mix": {"mean_entropy": 1.9}},
            },
        ],
    }
    (results / "target_select.json").write_text(json.dumps(select))
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert "## Unrecognised results files" not in md
    assert "| target_select.json | 1 | 2000 | - | 1.700 | 1.500 | 1.900 | 0.600 | yes |" in md
    # superseded files (the archived notes' History) are tabulated in the appendix, not in their main sections
    assert "| tiny_target_pretrain_120s_h200x2.json | 8L/512h | cuda | 1283 |" in _appendix(md)
    assert "tiny_target_pretrain_120s_h200x2.json" not in _section(md, "Tiny targets")
    assert "| online_run_regen_h200x2.json | 900 | 1800 | 0 | 492414 |" in md
    assert "| online_run_regen_h200x2_eval_draft.json | tiny-k25-tp2-step900 | corpus seed 20000 | 1.483 |" in md
    assert "| full | llama | 49 | 300 | 3.100 | 0.90 / 0.70 / 0.50 | 3.200 |" in md
    assert "| llama | 1455360 | 1.006 | 2.847 |" in md
    assert "| mooncake master SIGKILL | 1 / 1 | 137 | 37 | 200 | 4 | 0 | 0 |" in md
    assert (
        "| draft_logits_parity_h200.json | LlamaForCausalLMEagle3 | triton | 768 | 0.99999 | 0.38% | 0.993 | 28.7 | yes | 0 |"
        in md
    )
    assert "| offline_twin_tp1_h200.json | online | offline twin | 2.714 | 2.770 | +2.1% | yes |" in _appendix(md)
    assert "| mla_vs_llama_engine_tp1_h200.json | Llama-style | MLA | 2.770 | 2.681 | -3.2% | - |" in md
    # a twin against an earlier call's online bench says so; one that benched both sides does not
    pairs = md.split("## Same data, two drafts", 1)[1].split("\n## ", 1)[0]
    assert (
        "- `offline_twin_echo_tp1_h200.json`: the online side is "
        "`bench/results/acceptance_online_draft_echo_tp1_h200.json`"
    ) in pairs
    assert "- `offline_twin_tp1_h200.json`" not in pairs
    assert "| teacher_memory_cpu.json | 163840 | 2048 | 2.647 | 8.47 | 8.12 | 10 |" in md
    assert (
        "| trainer_memory_k25_b200_h200.json | NVIDIA H200 | 1 | flex_attention | 16384 | specforge | host | 69.15 | "
        "95.23 | 133.75 | 0.52x | 1.687 | 9715 | - |"
    ) in md
    assert (
        "| trainer_step_loss_curve_k25_b200_h200.json | NVIDIA H200 | 1 | flex_attention | 4096 | recipe | cuda | "
        "30.97 | 56.96 | 47.48 | 0.65x | 0.320 | 12791 | 0.494 / 0.612 |"
    ) in md
    assert (
        "| bench_sglang_test_untrained_tp1_h200.json | untrained | structured | 1.025 | 36.6 | 52.2 | 0.70x | 8/8 |"
        in md
    )
    assert "| pretrain_repro_h200.json | 1b6c33f | NVIDIA H200 | default | 300 / 300 | 2.739 / 2.495 |" in md
    assert "| online_run_mix_tp1_h200_eval_draft.json | tiny-k25-tp1-step2400 | prompt_mix/chat | 16 | 2.342 |" in (
        _appendix(md)
    )
    assert "| mooncake_put_cpu.json | 2 | 268 | 1 | 50.100 | 5.360 |" in md
    timing = md.split("## Where a capture call's time goes", 1)[1]
    assert (
        "| online_pipeline_tp1_h200_breakdown.json | tp1, 1 put client(s) | 64x1024 | 170.290 | 171.724 | "
        "179.953 | 228.803 | - | 26.977 | 4.277 |"
    ) in timing
    assert "| passthrough_cpu.json | 2 | 64x1024 | lists | 1.37 |" in timing
    assert "| passthrough_cpu.json | 2 | 16x4096 | compact | 0.57 |" in timing
    # a file of neither shape stays unrecognised rather than landing in these sections
    (results / "odd.json").write_text(json.dumps({"online": 1, "offline": 2, "command": "something else"}))
    assert "- `odd.json`" in report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")


def _section(md: str, title: str) -> str:
    """The main section ``## title`` (its first occurrence; the appendix's copies are ``###``)."""
    return md.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def _appendix(md: str) -> str:
    return md.split("\n## Appendix: superseded results and failed experiments", 1)[1]


def _copy_results(results: Path, *names: str) -> None:
    results.mkdir(exist_ok=True)
    for name in names:
        (results / name).write_text((REPO / "bench" / "results" / name).read_text())


def _headline_row(md: str, metric: str) -> str:
    head = _section(md, "Headline: the current figure per metric")
    (row,) = [r for r in head.splitlines() if r.startswith(f"| {metric}")]
    return row


def _k25_pipeline(transports: dict[str, float], run_report: dict | None = None) -> dict:
    """bench/online_pipeline.py's output on the K2.5-width slice (config.hidden 7168, runs with a transport)."""
    out = {
        "command": ["python3", "bench/online_pipeline.py", "--target", "runs/k25-slice"],
        "engine": "sglang",
        "config": {"target": "runs/k25-slice", "layers": 5, "hidden": 7168},
        "baseline_capture_over_plain": {"tp1": {"64x1024": 0.55, "16x4096": 0.91}},
        "runs": [
            {
                "tp": 1,
                "transport": t,
                "shapes": [
                    {
                        "batch": 4,
                        "tokens_per_prompt": 4096,
                        "plain_tokens_per_s": 20000.0,
                        "capture_tokens_per_s": 20000.0 * ratio,
                        "capture_over_plain": ratio,
                        "feature_bytes_per_token": 57344.0,
                        "capture_write_gb_per_s": 1.5,
                        "read_gb_per_s": 2.0,
                    }
                ],
            }
            for t, ratio in transports.items()
        ],
    }
    if run_report:
        out["online_run"] = run_report
    return out


def _prefill_depth(layers: int, plain: float) -> dict:
    return {
        "benchmark": "plain prefill of a running server (bench/prefill_depth.py)",
        "command": ["python3", "bench/prefill_depth.py"],
        "config": {
            "target": f"runs/k25-slice{layers}",
            "layers": layers,
            "hidden": 7168,
            "experts": 384,
            "experts_per_token": 8,
            "quantization": "int4-experts",
            "url": "http://127.0.0.1:31998",
        },
        "runs": [
            {
                "tp": 1,
                "transport": "none",
                "shapes": [
                    {
                        "batch": 4,
                        "tokens_per_prompt": 4096,
                        "tokens": 16384,
                        "reps": 3,
                        "seconds": [1.0, 1.0, 1.0],
                        "plain_tokens_per_s": plain,
                    }
                ],
            }
        ],
    }


def test_report_headline_reads_the_current_files(tmp_path):
    """Each headline row is read from the file it names; capture / plain and the slice's figures move to the K2.5-width
    files once they exist; sizing_k25.json (as bench/sizing.py writes it) gives the projection row."""
    report = _report_module()
    results = tmp_path / "results"
    _copy_results(
        results,
        "acceptance_online_draft_echo_tp1_h200.json",
        "offline_twin_echo_tp1_h200.json",
        "acceptance_offline_twin_echo_baseline_tp1_h200.json",
        "online_pipeline_tp1_h200_compact_headline.json",
        "online_run_echo_tp1_h200.json",
        "trainer_memory_k25_b200_h200.json",
        "trainer_step_lifts_k25_b200_h200.json",
    )
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert md.index("## Headline") < md.index("## Acceptance length")
    assert _headline_row(md, "acceptance length").startswith(
        "| acceptance length | **3.258** (threshold 3.0 passed; structured 3.472, chat 3.223, math 3.219, code 3.111) |"
    )
    assert _headline_row(md, "acceptance length").endswith("| `acceptance_online_draft_echo_tp1_h200.json` |")
    assert "| **+0.8%** (offline twin 3.284 vs online draft 3.258) |" in _headline_row(md, "offline twin vs online")
    assert "| **2.11x** (548.3 vs 259.9 output tok/s without speculation) |" in _headline_row(md, "speedup")
    capture = _headline_row(md, "capture / plain prefill")
    assert "| 64x1024 **0.73x**, 16x4096 **0.88x** |" in capture
    assert capture.endswith(
        "| `online_pipeline_tp1_h200_compact_headline.json` (`online_pipeline_k25_slice_h200.json` not measured yet) |"
    )
    e2e = _headline_row(md, "end-to-end / slowest stage")
    assert "| **0.92** (2,651 trained tok/s end to end vs 2,891 trainer-only) |" in e2e
    assert e2e.endswith(
        "`online_run_echo_tp1_h200.json` (`sizing_k25.json`, `online_run_k25_slice_cuda_ipc_h200.json` not measured yet) |"
    )
    assert "| **35.2 B** (494,435 trained tokens) |" in _headline_row(md, "bytes on disk per trained token")
    assert "| **0.52-0.88x** peak allocated / plan (6 lengths: flex_attention 2048-16384, sdpa 2048-4096 tokens); " in (
        _headline_row(md, "trainer memory vs plan")
    )
    assert "| not measured yet |" in _headline_row(md, "projected end-to-end tok/s per GPU, 8xB200")
    for title in ("Capture overhead at K2.5 width", "Plain prefill by depth", "Projected K2.5 run"):
        assert "Not measured yet" in _section(md, title), title

    # the real-width files land: the K2.5-width pipeline, the two depths, the slice's run-report, bench/sizing.py
    slice_run = json.loads((results / "online_run_echo_tp1_h200.json").read_text())
    slice_run.update(metadata_bytes_per_trained_token=12.5, run_id="kimi-k25-slice-h200")
    slice_run["perf"] = {**slice_run["perf"], "end_to_end_tokens_per_s": 1500.0, "trainer_only_tokens_per_s": 3000.0}
    (results / "online_run_k25_slice_cuda_ipc_h200.json").write_text(json.dumps(slice_run))
    online = {
        "source": "/out/online_run.json",
        "perf": slice_run["perf"],
        "gpu_memory": {"peak_mib_per_role": {"capture-server": 90000, "trainer": 40000}},
    }
    pipeline = _k25_pipeline({"mooncake": 0.8, "cuda_ipc": 0.95}, online)
    (results / "online_pipeline_k25_slice_h200.json").write_text(json.dumps(pipeline))
    (results / "prefill_depth_k25_slice5_h200.json").write_text(json.dumps(_prefill_depth(5, 20000.0)))
    (results / "prefill_depth_k25_slice3_h200.json").write_text(json.dumps(_prefill_depth(3, 30000.0)))
    spec = importlib.util.spec_from_file_location("sizing", REPO / "bench" / "sizing.py")
    sizing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sizing)
    doc = tmp_path / "sizing.md"
    doc.write_text(f"{sizing.BEGIN}\n{sizing.END}\n")
    r = str(results)
    assert sizing.main(["--results", r, "--out", f"{r}/sizing_k25.json", "--doc", str(doc)]) == 0
    res = json.loads((results / "sizing_k25.json").read_text())
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert "## Unrecognised results files" not in md
    capture = _headline_row(md, "capture / plain prefill")
    assert "| mooncake: 4x4096 **0.80x**; cuda_ipc: 4x4096 **0.95x** |" in capture
    assert capture.endswith("| `online_pipeline_k25_slice_h200.json` |")
    assert "| **0.50** (1,500 trained tok/s end to end; plain prefill 20,000, trainer-only 3,000) |" in (
        _headline_row(md, "end-to-end / slowest stage")
    )
    assert _headline_row(md, "end-to-end / slowest stage").endswith("| `sizing_k25.json` |")
    disk = _headline_row(md, "bytes on disk per trained token")
    assert "| **12.5 B**" in disk and disk.endswith("| `online_run_k25_slice_cuda_ipc_h200.json` |")
    b200 = res["recipes"]["kimi-k25-8xb200-lowered"]["transports"]
    ts = res["torchspec"]["tokens_per_s_per_gpu"]
    moon = b200["mooncake"]["end_to_end_tokens_per_s_per_gpu"]
    projection = _headline_row(md, "projected end-to-end tok/s per GPU, 8xB200")
    ipc = b200["cuda_ipc"]["end_to_end_tokens_per_s_per_gpu"]
    assert (
        f"| cuda_ipc **{ipc:,.0f}** ({ipc / ts:.2f}x); mooncake **{moon:,.0f}** ({moon / ts:.2f}x) tok/s per GPU "
        in (projection)
    )
    assert "(kimi-k25-8xb200-lowered, 1x8 B200, slowest stage " in projection and f"TorchSpec {ts:,.0f} |" in projection
    # the K2.5-width pipeline has its own section, per transport, and stays out of the tiny-width one
    k25 = _section(md, "Capture overhead at K2.5 width (real-width slice)")
    assert "| mooncake | tp1 | 4x4096 | 20000 | 16000 | 0.80x | 57344 | 1.50 | 2.00 |" in k25
    assert "| cuda_ipc | tp1 | 4x4096 | 20000 | 19000 | 0.95x | 57344 | 1.50 | 2.00 |" in k25
    assert "| end-to-end trained tok/s | 1500.000 |" in k25 and "| trainer | 40000 |" in k25
    assert "online_pipeline_k25_slice_h200.json" not in _section(md, "Capture overhead")
    depth = _section(md, "Plain prefill by depth (K2.5-width slices)")
    assert (
        "| prefill_depth_k25_slice3_h200.json | 3 | 7168 | 384 (8 per token) | int4-experts | 1 | 4x4096 | 30000 | 3 |"
        in (depth)
    )
    proj = _section(md, "Projected K2.5 run (`bench/sizing.py`)")
    moon_row = b200["mooncake"]
    assert "| kimi-k25-8xb200-lowered | 1x8 B200 | 8 |" in proj
    floor = moon_row["end_to_end_no_overlap_tokens_per_s_per_gpu"]
    assert (
        f"| mooncake | {moon:,.0f} ({floor:,.0f}) | {moon / ts:.2f}x | {moon_row['feature_gb_per_s_per_node']:.2f} ("
        in proj
    )
    assert "tok/s at 3 layers" in proj and "- assumed, tp_efficiency: 1 1.0, 8 0.7, 16 0.5 (" in proj
    assert "| online_run_k25_slice_cuda_ipc_h200.json | 3000 |" in _section(md, "Online runs (trainer view)")


def test_report_headline_missing_file_is_not_measured_yet(tmp_path):
    report = _report_module()
    results = tmp_path / "results"
    results.mkdir()
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    head = _section(md, "Headline: the current figure per metric")
    rows = [r for r in head.splitlines() if r.startswith("| ") and not r.startswith(("| metric", "| ---"))]
    assert len(rows) == len(report.HEADLINE)
    assert all(" | not measured yet | " in r for r in rows)
    assert "| `online_pipeline_k25_slice_h200.json` or `online_pipeline_tp1_h200_compact_headline.json` |" in head
    # a named file of an unexpected shape is said so, the report still written
    twin = {"command": "bash scripts/gpu_offline_twin.sh", "online": {}, "offline": {}}
    (results / "offline_twin_echo_tp1_h200.json").write_text(json.dumps(twin))
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert (
        "| offline twin vs online draft (acceptance length) | could not be read: KeyError: 'acceptance_length' |" in md
    )


def test_report_superseded_and_failed_go_to_the_appendix(tmp_path):
    """A file SUPERSEDED names leaves its main section for the appendix (a line with its reason, then its table);
    an entry scoped to sections leaves only those; an acceptance run below its threshold goes by itself."""
    report = _report_module()
    results = tmp_path / "results"
    _copy_results(
        results,
        "tiny_target_pretrain_h200x2.json",
        "tiny_target_pretrain_echo_h200.json",
        "online_pipeline_tp1_h200_compact.json",
        "online_pipeline_tp1_h200_compact_headline.json",
        "acceptance_online_draft_echo_tp1_h200.json",
        "acceptance_online_draft_taps_tp1_h200.json",
    )
    failed = json.loads((results / "acceptance_online_draft_echo_tp1_h200.json").read_text())
    failed["threshold"] = {**failed["threshold"], "acceptance_length": 2.5, "passed": False}
    (results / "acceptance_below.json").write_text(json.dumps(failed))
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    appendix = _appendix(md)
    main = md.split("\n## Appendix", 1)[0]
    targets = _section(md, "Tiny targets")
    assert "| tiny_target_pretrain_echo_h200.json |" in targets
    assert "tiny_target_pretrain_h200x2.json" not in targets
    assert "- `tiny_target_pretrain_h200x2.json`: superseded by tiny_target_pretrain_echo_h200.json on 2026-12-01" in (
        appendix
    )
    assert "| tiny_target_pretrain_h200x2.json | 8L/512h | cuda | 622 |" in appendix.split("### Tiny targets", 1)[1]
    # scoped: out of the capture overhead section, its breakdown still in the main one
    assert "online_pipeline_tp1_h200_compact.json" not in _section(md, "Capture overhead")
    assert "| online_pipeline_tp1_h200_compact_headline.json" not in _section(md, "Capture overhead")  # no file column
    assert "`online_pipeline_tp1_h200_compact_headline.json` (" in _section(md, "Capture overhead")
    assert "| online_pipeline_tp1_h200_compact.json | tp1, 1 put client(s) | 64x1024 |" in _section(
        md, "Where a capture call's time goes"
    )
    assert "| tp1 | 64x1024 | 411095 | 260888 | 0.63x |" in appendix.split("### Capture overhead", 1)[1]
    # below the threshold: out of the acceptance section, with the threshold as its reason
    acceptance = _section(md, "Acceptance length through SGLang EAGLE-3")
    assert "acceptance_online_draft_echo_tp1_h200.json" in acceptance
    assert "acceptance_below.json" not in acceptance and "acceptance_online_draft_taps_tp1_h200.json" not in acceptance
    assert "- `acceptance_below.json`: failed experiment: AL 2.500 below its 3.0 threshold" in appendix
    assert (
        "- `acceptance_online_draft_taps_tp1_h200.json`: deep aux taps on the step-bounded target (2026-12-01): no "
        "measurable difference from SGLang's default taps (docs/decisions/001-target-and-adapter.md); AL 2.159 below its "
        "3.0 threshold"
    ) in appendix
    assert "| acceptance_below.json | tiny 8L/512h, pretrained 1400 steps | 3/1/4 | structured |" in appendix
    assert "### Acceptance length" in appendix and "![acceptance]" not in appendix
    assert main.count("## Appendix") == 0 and md.count("\n## Appendix") == 1
    # a section whose every file is withdrawn says so
    md = report.build_report(
        results,
        tmp_path / "REPORT.md",
        tmp_path / "plots",
        superseded={**report.SUPERSEDED, "tiny_target_pretrain_echo_h200.json": "superseded by X on 2026-12-03"},
    )
    assert "Every file of this section is superseded or failed: see the appendix." in _section(md, "Tiny targets")
    assert "- `tiny_target_pretrain_echo_h200.json`: superseded by X on 2026-12-03" in _appendix(md)


def test_report_headline_and_superseded_agree_with_the_committed_results(tmp_path):
    """No headline file is superseded; every SUPERSEDED entry names a committed file; the committed results give a
    headline without a read error, and each superseded file is listed in the appendix, out of the main sections."""
    report = _report_module()
    committed = {p.name for p in (REPO / "bench" / "results").glob("*.json")}
    headline_files = {c.file for _, sources in report.HEADLINE for c in sources}
    assert not headline_files & set(report.SUPERSEDED)
    assert set(report.SUPERSEDED) <= committed
    md = report.build_report(REPO / "bench" / "results", tmp_path / "REPORT.md", tmp_path / "plots")
    assert "could not be read" not in _section(md, "Headline: the current figure per metric")
    appendix, main = _appendix(md), md.split("\n## Appendix", 1)[0]
    for name, entry in report.SUPERSEDED.items():
        assert f"- `{name}`: " in appendix, name
        if isinstance(entry, str):
            assert name not in main.split("\n## Acceptance length", 1)[1], name


def test_structured_requests_are_prefixes_of_the_training_rows():
    """What the bench sends for a held-out corpus conversation is exactly the prompt part of the row
    a draft trains on for that conversation (regenerated with ``--thinking auto``), in both modes:
    otherwise the draft is measured on contexts it never saw."""
    from specforge_kimi.data import corpus
    from specforge_kimi.data.chat_template import encode_spans, training_rows
    from specforge_kimi.data.conversation import conversation_from_record
    from specforge_kimi.data.corpus import HELDOUT_SEED
    from specforge_kimi.data.tokenizer import build_standin_tokenizer

    tok = build_standin_tokenizer()
    records = list(corpus.conversations(12, seed=HELDOUT_SEED))
    prompts = bench.structured_prompt_set(12).prompts
    modes = set()
    for rec, prompt in zip(records, prompts, strict=False):
        request = bench.encode_prompt(prompt, tok, thinking=True)
        (spans,) = training_rows(conversation_from_record(rec))
        ids, mask = encode_spans(spans, tok)
        assert ids[: len(request)] == request and not any(mask[: len(request)]), rec["id"]
        assert mask[len(request)] == 1, rec["id"]  # the first token the target generates is trained
        modes.add(prompt.thinking)
    assert modes == {True, False}


def test_report_resume_sections(tmp_path):
    """The Mooncake restart study, the GPU resume drills and the soak each get their table."""
    report = _report_module()
    results = tmp_path / "results"
    results.mkdir()
    restart = {
        "benchmark": "mooncake master restart",
        "environment": {"mooncake": "0.3.13"},
        "down_s": 10.0,
        "summary": {
            "down_put_s": [4.3],
            "master_restart_listen_s": 1.3,
            "first_put_after_restart_s": 1.0,
            "pre_kill_object_exists_after_restart": 0,
            "pre_kill_object_get_after_restart_rc": -704,
        },
    }
    drills = {
        "benchmark": "whole-run resume drills (issue 26)",
        "drills": {
            "kill twice": {
                "lost": 0,
                "duplicates": 0,
                "attempts": [
                    {
                        "attempt": 2,
                        "resumed_from_step": 20,
                        "ledger_step_before": 23,
                        "recaptured_acked": 3,
                        "time_to_first_resumed_step_s": 95.0,
                    }
                ],
            }
        },
    }
    soak = {
        "benchmark": "soak (issue 26)",
        "steps": 5000,
        "verdicts": {"trainer-rank:7/rss_bytes": {"median": 2e9, "rise": 1e6, "bound": 1e8, "flat": True}},
    }
    for name, doc in (("restart.json", restart), ("drills.json", drills), ("soak.json", soak)):
        (results / name).write_text(json.dumps(doc))
    md = report.build_report(results, tmp_path / "REPORT.md", tmp_path / "plots")
    assert "## Unrecognised results files" not in md
    assert "| restart.json | 0.3.13 | 10.000 | 4.30 | 1.300 | 1.000 | 0 | -704 |" in md
    assert "| drills.json | kill twice | 2 | 20 | 23 | 3 | 0 | 0 | 95.000 | - |" in md
    assert "| soak.json | 5000 | trainer-rank:7/rss_bytes | 2e+09 | 1e+06 | 1e+08 | yes |" in md


def test_committed_report_is_current(tmp_path):
    """bench/REPORT.md is what `python bench/report.py` makes of the committed results: a result added without
    rerunning it fails here, naming the command."""
    report = _report_module()
    md = report.build_report(REPO / "bench" / "results", tmp_path / "REPORT.md", tmp_path / "plots")
    md = md.replace(f"`{REPO / 'bench' / 'results'}/*.json`", "`bench/results/*.json`", 1)
    assert md == (REPO / "bench" / "REPORT.md").read_text(), "bench/REPORT.md is stale: run python bench/report.py"


def test_threshold_pools_the_named_sets_of_the_first_config():
    """The threshold is the first config's tokens per verify over the named sets together (not a mean of the sets'
    lengths), and passes at the minimum itself."""
    result = {
        "settings": {"threshold_sets": ["structured", "chat"]},
        "speculative": [
            {
                "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
                "sets": {
                    "math": {"completion_tokens": 90, "spec_verify_ct": 10},
                    "structured": {"completion_tokens": 30, "spec_verify_ct": 10},
                    "chat": {"completion_tokens": 10, "spec_verify_ct": 10},
                },
            },
            {"config": {"steps": 7}, "sets": {"structured": {"completion_tokens": 99, "spec_verify_ct": 1}}},
        ],
    }
    th = bench.check_threshold(result, 2.0)
    assert th == {
        "min_acceptance_length": 2.0,
        "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
        "sets": ["structured", "chat"],
        "acceptance_length": 2.0,  # 40 tokens in 20 verifies; the mean of 3.0 and 1.0 would also be 2.0, so:
        "passed": True,
    }
    result["speculative"][0]["sets"]["chat"] = {"completion_tokens": 30, "spec_verify_ct": 30}
    assert bench.check_threshold(result, 1.5)["acceptance_length"] == 1.5  # 60 / 40, not (3.0 + 1.0) / 2
    assert bench.check_threshold(result, 1.51)["passed"] is False
    result["settings"]["threshold_sets"] = None  # every set of the first config
    assert bench.check_threshold(result, 1.0)["acceptance_length"] == 150 / 50
    assert bench.check_threshold(result, None) is None


# ---------------------------------------------------------------------------------------------
# DFLASH (block drafts)
# ---------------------------------------------------------------------------------------------
def _dflash_draft(tmp_path: Path, block: int = 8) -> Path:
    draft = tmp_path / "dflash"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                "max_position_embeddings": 4096,
                "block_size": block,
                "dflash_config": {"target_layer_ids": [1, 2, 3], "mask_token_id": 5},
            }
        )
    )
    return draft


def test_dflash_config_parses_and_builds_sglangs_flags(tmp_path):
    assert bench.parse_spec_config("DFLASH,8") == bench.DFlashConfig(8)
    assert bench.parse_spec_config("dflash/4").argv() == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-dflash-block-size",
        "4",
    ]
    for bad in ("DFLASH,1", "DFLASH,8,2", "DFLASH,x"):
        with pytest.raises(KimiInputError):
            bench.parse_spec_config(bad)
    target, _ = _dirs(tmp_path)
    draft = _dflash_draft(tmp_path)
    s = BenchSettings(target=str(target), draft=str(draft), configs=[bench.parse_spec_config("DFLASH")])
    s.validate()  # DFLASH alone takes the draft's block size
    assert s.configs == [bench.DFlashConfig(8)]
    argv = bench.server_argv(s, s.configs[0], port=1, context=4096, python="python")
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(draft)
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-dflash-block-size") + 1] == "8"
    # steps/topk/draft tokens are SGLang's to force for DFLASH: never passed
    assert not {"--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"} & set(argv)
    assert bench.DFlashConfig(8).config_dict() == {"steps": 1, "topk": 1, "draft_tokens": 8}
    # an algorithm that does not serve the draft is refused
    with pytest.raises(KimiInputError, match="serves with DFLASH"):
        BenchSettings(target=str(target), draft=str(draft), configs=[SpecConfig(3, 1, 4)]).validate()
    (tmp_path / "e").mkdir()
    _, eagle = _dirs(tmp_path / "e")
    with pytest.raises(KimiInputError, match="serves with EAGLE3"):
        BenchSettings(target=str(target), draft=str(eagle), configs=[bench.DFlashConfig(8)]).validate()


@pytest.mark.slow
def test_dflash_argv_parses_with_sglangs_own_parser(tmp_path):
    from specforge_kimi.servers.capture_server import parse_text_only_args

    target, _ = _dirs(tmp_path)
    s = BenchSettings(target=str(target), draft=str(_dflash_draft(tmp_path)), configs=[bench.DFlashConfig(8)])
    ns = parse_text_only_args(bench.server_argv(s, s.configs[0], port=30001, context=4096)[3:])
    assert (ns.speculative_algorithm, ns.speculative_dflash_block_size) == ("DFLASH", 8)


def test_dflash_per_position_is_over_the_block_minus_one():
    m = bench.summarize(
        [{"meta_info": _meta([1, 0, 2, 0, 0, 0, 0, 1], draft_tokens=8)}], wall_s=1, spec=bench.DFlashConfig(8)
    )
    assert len(m["per_position"]["at_least"]) == 7 and m["per_position"]["at_least"][6] == pytest.approx(1 / 4)
    assert m["acceptance_length"] == pytest.approx((1 + 11 + 4) / 4)


def test_dflash_bench_against_a_stand_in_server_has_eagle3s_shape(tmp_path, fake_server):
    common, eagle, dflash = _pair_settings(tmp_path)
    e = bench.run_bench(
        BenchSettings(draft=str(eagle), configs=[SpecConfig(3, 1, 4)], out_dir=str(tmp_path / "e"), **common),
        launcher=fake_server,
    )
    d = bench.run_bench(
        BenchSettings(draft=str(dflash), configs=[bench.DFlashConfig(8)], out_dir=str(tmp_path / "d"), **common),
        launcher=fake_server,
    )
    assert set(d) == set(e)
    (er,), (dr,) = e["speculative"], d["speculative"]
    assert set(dr) == set(er) and {"algorithm", "block_size"} <= set(dr)
    assert (er["algorithm"], er["block_size"], dr["algorithm"], dr["block_size"]) == ("EAGLE3", None, "DFLASH", 8)
    assert dr["config"] == {"steps": 1, "topk": 1, "draft_tokens": 8} and set(dr["config"]) == set(er["config"])
    for key in ("sets", "overall", "speedup"):
        assert set(dr[key]) == set(er[key])
    assert set(dr["overall"]) == set(er["overall"])
    ov = dr["overall"]
    assert ov["histogram_consistent"] and len(ov["per_position"]["at_least"]) == 7
    assert ov["acceptance_length"] == pytest.approx(ov["completion_tokens"] / ov["spec_verify_ct"])
    assert dr["speedup"]["overall"] is not None and dr["output_match"]["structured"]["different"] == 0
    assert d["settings"]["configs"] == [
        {"steps": 1, "topk": 1, "draft_tokens": 8, "algorithm": "DFLASH", "block_size": 8}
    ]
    assert {p.name for p in (tmp_path / "d" / "logs").iterdir()} == {"baseline.log", "dflash-8.log"}


def test_recipe_bench_section_picks_dflash(tmp_path):
    from types import SimpleNamespace

    target, _ = _dirs(tmp_path)
    draft = _dflash_draft(tmp_path, block=16)
    srv = SimpleNamespace(
        attention_backend="triton", mem_fraction_static=None, disable_cuda_graph=False, allreduce_fusion=True,
        extra_args=[], port=None,
    )  # fmt: skip
    recipe = SimpleNamespace(
        target=SimpleNamespace(path=str(target)),
        bench=SimpleNamespace(min_acceptance_length=2.0, algorithm="DFLASH", block_size=None, steps=3, topk=1,
                              draft_tokens=4, cuda_graph=True),
        server=srv, gpus=SimpleNamespace(per_node=1), output_dir=str(tmp_path / "run"),
    )  # fmt: skip
    s = bench.recipe_settings(recipe, draft)
    s.validate()
    assert s.configs == [bench.DFlashConfig(16)]
    recipe.bench.block_size = 8
    assert bench.recipe_settings(recipe, draft).configs == [bench.DFlashConfig(8)]


def test_cli_defaults_to_dflash_for_a_block_draft(tmp_path):
    import argparse

    target, _ = _dirs(tmp_path)
    draft = _dflash_draft(tmp_path)
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    s = bench.settings_from_args(p.parse_args(["--target", str(target), "--draft", str(draft)]))
    assert s.configs == [bench.DFlashConfig(None)]
    s = bench.settings_from_args(p.parse_args(["--target", str(target), "--draft", str(draft), "--config", "DFLASH,4"]))
    assert s.configs == [bench.DFlashConfig(4)]


def test_report_colocated_row_divides_by_the_stages_measured_alone():
    """The honest co-located ratio: over the trainer measured alone and the serial sum, not the in-run rates."""
    report = _report_module()
    run = {"perf": {"end_to_end_tokens_per_s": 8000.0, "trainer_only_tokens_per_s": 8100.0}}
    alone = {
        "rows": [
            {"variant": "specforge", "length": 4096, "tokens_per_s": 9000.0},
            {"variant": "recipe", "length": 16384, "tokens_per_s": 7000.0},
            {"variant": "recipe", "length": 4096, "tokens_per_s": 10000.0},
        ]
    }
    prefill = {"runs": [{"shapes": [{"plain_tokens_per_s": 40000.0}]}]}
    by_name = {report.TRAINER_ALONE_FILE: alone, report.PREFILL_ALONE_FILE: prefill}
    text = report._read_colocated_over_alone(run, by_name)
    assert text.startswith("**0.80** of the trainer alone, **1.00** of the serial sum")  # serial = 8,000
    rows = report.section_headline(
        {"online_run_k25_slice_shipped_h200.json": run, **by_name},
        headline=[
            (
                "co-located",
                [
                    report.Source(
                        "online_run_k25_slice_shipped_h200.json",
                        report._read_colocated_over_alone,
                        "",
                        needs_index=True,
                    )
                ],
            )
        ],
    )
    assert any("**0.80** of the trainer alone" in line for line in rows)


# ---------------------------------------------------------------------------------------------
# --baseline-from: an earlier bench's baseline, like for like
# ---------------------------------------------------------------------------------------------
def _pair_settings(tmp_path: Path) -> tuple[dict, Path, Path]:
    """Bench settings shared by an EAGLE-3 draft and a DFlash draft of one tiny target: (settings, eagle, dflash)."""
    target, eagle = _dirs(tmp_path)
    common = dict(
        target=str(target),
        sets=["structured"],
        num_prompts=3,
        max_new_tokens=64,
        warmup=1,
        standin_tokenizer=True,
        check_draft=False,
        start_timeout_s=60,
    )
    return common, eagle, _dflash_draft(tmp_path)


def test_baseline_from_an_earlier_bench_serves_no_second_baseline(tmp_path, fake_server, monkeypatch):
    """The EAGLE-3 bench serves the baseline and leaves its greedy outputs; the DFlash bench of the same target
    takes that baseline (no baseline server of its own) and divides by its tok/s, outputs checked against it."""
    common, eagle, dflash = _pair_settings(tmp_path)
    e = bench.run_bench(
        BenchSettings(draft=str(eagle), configs=[SpecConfig(3, 1, 4)], out_dir=str(tmp_path / "e"), **common),
        launcher=fake_server,
    )
    outputs = json.loads((tmp_path / "e" / "baseline_outputs.json").read_text())
    assert [len(r["output_ids"]) > 0 for r in outputs["sets"]["structured"]] == [True] * 3
    served = len((tmp_path / "pids").read_text().split())

    def dflash_bench(source, out):  # the DFlash bench on a baseline taken from source, written to out
        return bench.run_bench(
            BenchSettings(
                draft=str(dflash),
                configs=[bench.DFlashConfig(8)],
                baseline_from=str(source),
                out_dir=str(tmp_path / out),
                **common,
            ),
            launcher=fake_server,
        )

    reads = []
    devices = bench._devices
    with monkeypatch.context() as m:
        m.setattr(bench, "_devices", lambda: reads.append(1) or devices())
        d = dflash_bench(tmp_path / "e", "d")
    assert len(reads) == 1  # read once: the baseline is checked against what the result records
    assert len((tmp_path / "pids").read_text().split()) == served + 1  # the DFlash server only
    (spec_run,) = d["speculative"]  # per-prompt counters per set only (a prompt id may repeat across sets)
    assert "per_request" not in spec_run["overall"]
    assert [r["id"] for r in spec_run["sets"]["structured"]["per_request"]] == [
        r["id"] for r in outputs["sets"]["structured"]
    ]
    assert {p.name for p in (tmp_path / "d" / "logs").iterdir()} == {"dflash-8.log"}
    assert json.loads((tmp_path / "d" / "baseline_outputs.json").read_text()) == outputs  # passed on
    reused = d["baseline"].pop("reused_from")
    assert d["baseline"] == e["baseline"]
    assert reused["path"] == str((tmp_path / "e" / "bench_result.json").resolve()) and len(reused["sha256"]) == 64
    assert reused["date_utc"] == e["date_utc"] and reused["outputs"].endswith("baseline_outputs.json")
    assert reused["reused_from"] is None  # measured there, not taken in turn
    # a third bench takes it from the second: the chain names both, the outputs still checked
    d3 = dflash_bench(tmp_path / "d", "d3")
    chain = d3["baseline"].pop("reused_from")
    assert d3["baseline"] == e["baseline"]
    assert chain["path"].endswith("/d/bench_result.json") and chain["reused_from"]["path"] == reused["path"]
    assert d3["speculative"][0]["output_match"]["structured"]["identical"] == 3
    served = len((tmp_path / "pids").read_text().split())
    (run,) = d["speculative"]
    base = e["baseline"]["sets"]["structured"]["output_tok_per_s"]
    assert run["speedup"]["structured"] == pytest.approx(run["sets"]["structured"]["output_tok_per_s"] / base)
    assert run["output_match"]["structured"] == {"identical": 3, "different": 0, "first_different": []}
    # a baseline that left no outputs (an older bench) still gives the speedup, without the output check
    (tmp_path / "e" / "baseline_outputs.json").unlink()
    d2 = dflash_bench(tmp_path / "e" / "bench_result.json", "d2")
    (run2,) = d2["speculative"]
    assert run2["output_match"] is None and run2["speedup"]["overall"] is not None
    assert d2["baseline"]["reused_from"]["outputs"] is None
    # d now holds a baseline taken without outputs: the outputs d's first bench left there are gone with it
    d2b = dflash_bench(tmp_path / "e", "d")
    assert d2b["speculative"][0]["output_match"] is None and not (tmp_path / "d" / "baseline_outputs.json").exists()
    assert len((tmp_path / "pids").read_text().split()) == served + 2  # the DFlash servers only, again


def test_baseline_from_refuses_what_is_not_like_for_like_before_serving(tmp_path, fake_server, monkeypatch):
    common, eagle, dflash = _pair_settings(tmp_path)
    bench.run_bench(
        BenchSettings(draft=str(eagle), configs=[SpecConfig(3, 1, 4)], out_dir=str(tmp_path / "e"), **common),
        launcher=fake_server,
    )
    bench.run_bench(
        BenchSettings(
            draft=str(eagle), configs=[SpecConfig(3, 1, 4)], baseline=False, out_dir=str(tmp_path / "nb"), **common
        ),
        launcher=fake_server,
    )
    (tmp_path / "junk.json").write_text('{"benchmark": "trainer_memory"}')
    served = len((tmp_path / "pids").read_text().split())

    def attempt(source, **over):
        s = BenchSettings(
            draft=str(dflash),
            configs=[bench.DFlashConfig(8)],
            baseline_from=str(source),
            out_dir=str(tmp_path / "d"),
            **{**common, **over},
        )
        with pytest.raises(KimiInputError) as exc:
            bench.run_bench(s, launcher=fake_server)
        msg = str(exc.value)
        assert msg.startswith(f"--baseline-from {source}") and "\n" not in msg, msg
        return msg

    assert "settings: its max_new_tokens 64 is not this bench's 32" in attempt(tmp_path / "e", max_new_tokens=32)
    assert "settings: its num_prompts 3 is not this bench's 2" in attempt(tmp_path / "e", num_prompts=2)
    assert "settings: its extra_server_args [] is not" in attempt(tmp_path / "e", extra_server_args=["--x"])
    assert "holds no baseline" in attempt(tmp_path / "nb")
    assert "is not a bench result" in attempt(tmp_path / "junk.json")
    shutil.copytree(tmp_path / "e", tmp_path / "d", dirs_exist_ok=True)
    assert "is this bench's own --out, which it would overwrite" in attempt(tmp_path / "d")
    assert "cannot read" in attempt(tmp_path / "missing")
    monkeypatch.setattr(bench, "_devices", lambda: ["NVIDIA H200, 143771 MiB"])
    assert "not like for like: its devices" in attempt(tmp_path / "e")
    monkeypatch.undo()
    cfg = json.loads((Path(common["target"]) / "config.json").read_text())
    (Path(common["target"]) / "config.json").write_text(json.dumps({**cfg, "retrained": 1}))
    assert "target: its config_sha256" in attempt(tmp_path / "e")
    assert len((tmp_path / "pids").read_text().split()) == served  # nothing was served for a refused reuse
    with pytest.raises(KimiInputError, match="--no-baseline runs none: pick one"):
        BenchSettings(
            draft=str(dflash),
            configs=[bench.DFlashConfig(8)],
            baseline=False,
            baseline_from=str(tmp_path / "e"),
            **common,
        ).validate()


def test_the_tiny_recipe_and_its_dflash_twin_can_share_one_baseline(tmp_path):
    """The tiny comparison's second bench takes the first's baseline: the two recipes agree on every setting
    the baseline depends on, and on its server's command line (port aside)."""
    from dataclasses import asdict

    from specforge_kimi.evaluate import baseline_reuse
    from specforge_kimi.plan.run_plan import load_recipe

    target, eagle = _dirs(tmp_path)
    dflash = _dflash_draft(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, ea = _recipe_on(tmp_path / "a", "tiny-k25-tp1-h200.yaml", target)
    _, da = _recipe_on(tmp_path / "b", "tiny-k25-tp1-h200-dflash.yaml", target)
    es = bench.recipe_settings(load_recipe(ea), eagle)
    ds = bench.recipe_settings(load_recipe(da), dflash)
    es.validate()
    ds.validate()
    keys = baseline_reuse.BASELINE_SETTINGS
    assert {k: asdict(es)[k] for k in keys} == {k: asdict(ds)[k] for k in keys}
    ctx_e, ctx_d = bench.context_length(es, 100), bench.context_length(ds, 100)
    assert ctx_e == ctx_d
    assert bench.server_argv(es, None, port=1, context=ctx_e) == bench.server_argv(ds, None, port=1, context=ctx_d)
