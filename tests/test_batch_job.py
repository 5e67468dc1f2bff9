"""Offline batch jobs: good and bad rows, exactly-once output, resume after a torn line and after kill -9, shards."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

try:
    from tests.serving_fixtures import (export_tiny_target, read_jsonl, shared_tiny_llm, tiny_chat_tokenizer,
                                        write_jsonl)
except ImportError:  # tests/ itself on sys.path
    from serving_fixtures import export_tiny_target, read_jsonl, shared_tiny_llm, tiny_chat_tokenizer, write_jsonl

from specjax.api import SamplingParams
from specjax.jobs import Shard, default_errors_path, shard_output_path
from specjax.serving.batch_job import run_batch_job

REPO = pathlib.Path(__file__).resolve().parents[1]


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + k) % 50 for k in range(3 + i % 5)]


@pytest.fixture(scope="module")
def llm():
    return shared_tiny_llm()


def _ids(rows):
    return [r["id"] for r in rows]


def test_good_and_malformed_rows_exactly_once(llm, tmp_path):
    rows: list = []
    for i in range(10):
        r = {"id": f"r{i}", "prompt": _prompt(i), "max_tokens": 3 + i, "temperature": 0}
        if i % 3 == 1:
            r.update(temperature=0.8, top_k=5, seed=i)  # sampled rows with their own seed
        rows.append(r)
    rows.insert(4, '{"id": "bad-json", "prompt": [1, 2')  # line 5
    rows.insert(8, {"id": "no-prompt", "max_tokens": 4})  # line 9
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), defaults=SamplingParams(max_tokens=8),
                      progress=False)
    outs = read_jsonl(out)
    assert sorted(_ids(outs)) == sorted(f"r{i}" for i in range(10))  # each good id exactly once
    errs = read_jsonl(default_errors_path(str(out)))
    assert [(e["line"], e["id"]) for e in errs] == [(5, None), (9, "no-prompt")]
    assert "malformed JSON" in errs[0]["error"]
    assert errs[1]["field"] == "prompt" and "prompt" in errs[1]["error"]
    assert (s.completed, s.errors, s.rows) == (10, 2, 12)
    by_id = {r["id"]: r for r in outs}
    for i in range(10):
        r = by_id[f"r{i}"]
        assert r["completion_tokens"] == len(r["token_ids"]) <= 3 + i
        assert r["finish_reason"] in ("stop", "length")
        assert r["prompt_tokens"] == len(_prompt(i))
        assert set(r["metrics"]) >= {"mean_acceptance_length", "num_drafts", "accepted_per_pos"}
    # greedy rows are keyed to the right prompt: the same tokens as generating that prompt alone
    greedy = [i for i in range(10) if i % 3 != 1]
    ref = llm.generate([_prompt(i) for i in greedy],
                       [SamplingParams(temperature=0, max_tokens=3 + i) for i in greedy])
    for i, o in zip(greedy, ref):
        assert by_id[f"r{i}"]["token_ids"] == o.token_ids, i
    assert s.metrics["spec_decode"]["num_drafts"] == sum(r["metrics"]["num_drafts"] for r in outs)

    # a rerun finds everything done: no new rows, no duplicates
    before = (out.read_bytes(), pathlib.Path(default_errors_path(str(out))).read_bytes())
    s2 = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
    assert (s2.completed, s2.errors, s2.skipped_done) == (0, 0, 12)
    assert (out.read_bytes(), pathlib.Path(default_errors_path(str(out))).read_bytes()) == before


def test_bad_rows_are_reported_with_reasons(llm, tmp_path):
    rows = [
        {"id": "ok", "prompt": [5, 6, 7], "max_tokens": 2},
        {"id": "ok", "prompt": [8, 9], "max_tokens": 2},  # duplicate id
        {"id": "hot", "prompt": [5, 6], "temperature": -1.0},
        {"id": "long", "prompt": [5] * 200},  # does not fit max_model_len 128
        {"id": "vocab", "prompt": [5, 999]},
        {"id": "typo", "prompt": [5, 6], "max_token": 3},
        {"id": "text", "prompt": "hello"},  # string prompt, but the target has no tokenizer
        {"id": True, "prompt": [5]},
        [1, 2, 3],
    ]
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "o.jsonl", tmp_path / "errs.jsonl"
    write_jsonl(inp, rows)
    s = run_batch_job(llm, str(inp), str(out), errors_path=str(err), shard=Shard(0, 1), progress=False)
    assert _ids(read_jsonl(out)) == ["ok"]
    errs = {e["line"]: e for e in read_jsonl(err)}
    assert sorted(errs) == list(range(2, 10)) and s.errors == 8
    assert "duplicate id" in errs[2]["error"] and "line 1" in errs[2]["error"] and errs[2]["field"] == "id"
    assert errs[3]["field"] == "temperature"
    assert errs[4]["field"] == "prompt" and "too long" in errs[4]["error"]
    assert "vocabulary" in errs[5]["error"]
    assert errs[6]["field"] == "max_token"
    assert "tokenizer" in errs[7]["error"]
    assert errs[8]["field"] == "id" and errs[8]["id"] is None
    assert "JSON object" in errs[9]["error"]


def test_text_prompts_messages_and_stop_strings_with_a_tokenizer(llm, tmp_path):
    saved = llm.tokenizer
    llm.tokenizer = tiny_chat_tokenizer()
    try:
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        write_jsonl(inp, [{"id": "ids", "prompt": [5, 6, 7, 9], "max_tokens": 6, "temperature": 0},
                          {"id": "text", "prompt": "w5 w6 w7 w9", "max_tokens": 6, "temperature": 0,
                           "metadata": {"k": 1}},
                          {"id": "chat", "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 6,
                           "temperature": 0}])
        run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
        by_id = {r["id"]: r for r in read_jsonl(out)}
        ref = by_id["ids"]
        assert len(ref["token_ids"]) == 6 and ref["text"] == llm.tokenizer.decode(ref["token_ids"])
        for k in ("text", "chat"):  # the same 4 prompt tokens, reached from text and through the template
            assert by_id[k]["token_ids"] == ref["token_ids"] and by_id[k]["prompt_tokens"] == 4
        assert by_id["text"]["metadata"] == {"k": 1}
        words = ref["text"].split()
        cut = next(i for i in range(1, len(words)) if words[i] not in " ".join(words[:i]))
        inp2, out2 = tmp_path / "in2.jsonl", tmp_path / "out2.jsonl"
        write_jsonl(inp2, [{"id": "s", "prompt": "w5 w6 w7 w9", "max_tokens": 6, "temperature": 0,
                            "stop": words[cut]},
                           {"id": "kept", "prompt": "w5 w6 w7 w9", "max_tokens": 6, "temperature": 0,
                            "stop": words[cut], "include_stop_str_in_output": True},
                           {"id": "cut", "prompt": [8] * 300 + [5, 6, 7, 9], "max_tokens": 6, "temperature": 0,
                            "truncate_prompt_tokens": 4},
                           {"id": "uncut", "prompt": [8] * 300 + [5, 6, 7, 9], "max_tokens": 6},
                           {"id": "cut-big", "prompt": [5, 6, 7, 9], "truncate_prompt_tokens": 10 ** 6},
                           {"id": "prio", "prompt": [5, 6, 7, 9], "priority": 2}])
        run_batch_job(llm, str(inp2), str(out2), shard=Shard(0, 1), progress=False)
        by_id = {r["id"]: r for r in read_jsonl(out2)}
        row = by_id["s"]
        assert row["finish_reason"] == "stop" and row["text"].split() == words[:cut] and row["stop_reason"] == words[cut]
        assert row["token_ids"] == ref["token_ids"][:cut + 1]  # through the token completing the stop (vLLM's)
        assert by_id["kept"]["text"].split() == words[:cut + 1] and by_id["kept"]["finish_reason"] == "stop"
        assert by_id["cut"]["token_ids"] == ref["token_ids"] and by_id["cut"]["prompt_tokens"] == 4
        errs = {e["id"]: e for e in read_jsonl(default_errors_path(str(out2)))}
        assert errs["uncut"]["field"] == "prompt" and "too long" in errs["uncut"]["error"]  # control
        assert errs["cut-big"]["field"] == "truncate_prompt_tokens" and "max_model_len" in errs["cut-big"]["error"]
        assert errs["prio"]["field"] == "priority" and "--scheduling-policy priority" in errs["prio"]["error"]
    finally:
        llm.tokenizer = saved


def test_llm_generate_truncates_prompts_and_keeps_stop_strings_when_asked(llm):
    """The Python API's vLLM fields: truncate_prompt_tokens (Output.prompt_token_ids are the ids kept) and
    include_stop_str_in_output (control: the same stop without it ends before the word)."""
    saved = llm.tokenizer
    llm.tokenizer = tiny_chat_tokenizer()
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6)
        (ref,) = llm.generate([[5, 6, 7, 9]], greedy)
        (cut,) = llm.generate([[8] * 200 + [5, 6, 7, 9]], SamplingParams(temperature=0, max_tokens=6,
                                                                         truncate_prompt_tokens=4))
        assert cut.prompt_token_ids == [5, 6, 7, 9] and cut.token_ids == ref.token_ids
        with pytest.raises(ValueError, match="does not fit the context"):  # control: uncut, 204 tokens
            llm.generate([[8] * 200 + [5, 6, 7, 9]], greedy)
        words = ref.text.split()
        cut_at = next(i for i in range(1, len(words)) if words[i] not in " ".join(words[:i]))
        (kept,), (dropped,) = (llm.generate([[5, 6, 7, 9]], SamplingParams(
            temperature=0, max_tokens=6, stop=words[cut_at], include_stop_str_in_output=inc)) for inc in (True, False))
        assert kept.text.split() == words[:cut_at + 1] and dropped.text.split() == words[:cut_at]
        assert kept.finish_reason == dropped.finish_reason == "stop" and kept.stop_reason == words[cut_at]
    finally:
        llm.tokenizer = saved


def test_openai_batch_lines_answer_openai_objects_resume_by_custom_id_and_name_bad_fields(llm, tmp_path):
    """OpenAI batch lines (`vllm run-batch`'s input) beside native rows: chat and completion answers
    equal the native row's greedy tokens; a rerun after the output lost its last line redoes only that
    custom_id; bad lines name the field by its path in the line."""
    saved = llm.tokenizer
    llm.tokenizer = tiny_chat_tokenizer()
    chat = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "temperature": 0, "model": "m", "stream": False}
    rows = [{"id": "native", "prompt": [5, 6, 7, 9], "max_tokens": 6, "temperature": 0},
            {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
             "body": {**chat, "max_completion_tokens": 6, "n": 1, "response_format": {"type": "text"}}},
            {"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "w5 w6 w7 w9", "max_tokens": 6,
                                                                   "temperature": 0, "ignore_eos": True}},
            {"custom_id": "bad-url", "url": "/v1/embeddings", "body": {"input": "w5"}},
            {"custom_id": "bad-top-p", "url": "/v1/completions", "body": {"prompt": [5], "top_p": 2}},
            {"custom_id": "bad-n", "url": "/v1/chat/completions", "body": {**chat, "n": 0}},
            {"custom_id": "unserved", "url": "/v1/completions", "body": {"prompt": [5], "best_of": 3}},
            {"custom_id": "tools", "url": "/v1/chat/completions", "body": {**chat, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f"}}]}},
            {"custom_id": "bias", "url": "/v1/completions", "body": {"prompt": [5], "logit_bias": {"5": 1}}},
            {"custom_id": "penalty", "url": "/v1/completions", "body": {"prompt": [5], "presence_penalty": 0.5}},
            {"custom_id": "wrong-key", "url": "/v1/completions", "body": {"messages": chat["messages"]}},
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [5]}},  # duplicate custom_id
            {"custom_id": "extra", "url": "/v1/completions", "body": {"prompt": [5]}, "id": 3}]
    try:
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        write_jsonl(inp, rows)
        s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
        assert (s.completed, s.errors) == (3, 10)
        outs = read_jsonl(out)
        native = next(r for r in outs if r.get("id") == "native")
        by_cid = {r["custom_id"]: r for r in outs if "custom_id" in r}
        c, t = by_cid["c"]["response"], by_cid["t"]["response"]
        assert c["status_code"] == t["status_code"] == 200 and by_cid["c"]["error"] is None
        assert c["body"]["object"] == "chat.completion" and c["body"]["model"] == "m"
        assert c["body"]["choices"][0]["message"]["content"] == native["text"]
        assert t["body"]["object"] == "text_completion" and t["body"]["choices"][0]["text"] == native["text"]
        for r in (c, t):
            assert r["body"]["choices"][0]["token_ids"] == native["token_ids"]
            assert r["body"]["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
            assert r["body"]["spec_metrics"]["num_drafts"] >= 0
        errs = {e["id"]: e for e in read_jsonl(default_errors_path(str(out)))}
        assert {k: e["field"] for k, e in errs.items()} == {
            "bad-url": "url", "bad-top-p": "body.top_p", "bad-n": "body.n", "unserved": "body.best_of", "tools": "body.tool_choice", "bias": "body.logit_bias",
            "penalty": "body.presence_penalty",
            "wrong-key": "body.messages", "c": "id", "extra": "id"}
        assert "duplicate id" in errs["c"]["error"] and "unknown field" in errs["extra"]["error"]
        assert "--guided-regex" in errs["tools"]["error"]  # tool calls are guided: this job serves none
        # resume: the output's last line lost, the rerun redoes that row alone
        lines = out.read_text().splitlines(keepends=True)
        lost = json.loads(lines[-1])
        out.write_text("".join(lines[:-1]))
        s2 = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
        assert s2.completed == 1 and s2.skipped_done == 12
        again = read_jsonl(out)[-1]
        assert again.get("custom_id", again.get("id")) == lost.get("custom_id", lost.get("id"))
    finally:
        llm.tokenizer = saved


def test_logprobs_in_native_rows_and_openai_lines_are_the_engines(llm, tmp_path):
    """`logprobs` k in a native row and in OpenAI lines (completions k; chat true + top_logprobs) answer
    OpenAI's objects with the engine's entries (the same request through LLM.generate); over the job's
    --max-logprobs, echo and prompt_logprobs are error rows naming the field (control: a row without
    logprobs has none)."""
    from specjax.serving.logprob_blocks import logprobs_block
    saved = llm.tokenizer
    llm.tokenizer = tiny_chat_tokenizer()
    try:
        (ref,) = llm.generate([[5, 6, 7, 9]], SamplingParams(temperature=0, max_tokens=5, logprobs=2))
        chat_body = {"messages": [{"role": "user", "content": "w5 w6 w7"}], "temperature": 0, "max_tokens": 5}
        rows = [{"id": "n", "prompt": [5, 6, 7, 9], "max_tokens": 5, "temperature": 0, "logprobs": 2},
                {"id": "none", "prompt": [5, 6, 7, 9], "max_tokens": 5, "temperature": 0},
                {"custom_id": "t", "url": "/v1/completions", "body": {"prompt": [5, 6, 7, 9], "max_tokens": 5,
                                                                      "temperature": 0, "logprobs": 2}},
                {"custom_id": "c", "url": "/v1/chat/completions", "body": {**chat_body, "logprobs": True,
                                                                           "top_logprobs": 2}},
                {"id": "big", "prompt": [5], "logprobs": 21},
                {"custom_id": "echo", "url": "/v1/completions", "body": {"prompt": [5], "echo": True}},
                {"custom_id": "plp", "url": "/v1/completions", "body": {"prompt": [5], "prompt_logprobs": 1}},
                {"custom_id": "top", "url": "/v1/chat/completions", "body": {**chat_body, "top_logprobs": 2}}]
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        write_jsonl(inp, rows)
        run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
        by = {r.get("custom_id", r.get("id")): r for r in read_jsonl(out)}
        want = logprobs_block(llm.tokenizer, ref.token_ids, ref.logprobs, chat=False)

        def same(block):  # rows decoded side by side: equal up to float32 batch-composition noise
            return (block["tokens"] == want["tokens"] and block["text_offset"] == want["text_offset"]
                    and block["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
                    and all(a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
                            for a, b in zip(block["top_logprobs"], want["top_logprobs"])))
        assert by["n"]["token_ids"] == ref.token_ids and same(by["n"]["logprobs"]) and "logprobs" not in by["none"]
        assert same(by["t"]["response"]["body"]["choices"][0]["logprobs"])
        content = by["c"]["response"]["body"]["choices"][0]["logprobs"]["content"]
        assert [len(x["top_logprobs"]) for x in content] == [2] * len(content) and content[0]["logprob"] <= 0
        errs = {e["id"]: e["field"] for e in read_jsonl(default_errors_path(str(out)))}
        assert errs == {"big": "logprobs", "echo": "body.echo", "plp": "body.prompt_logprobs",
                        "top": "body.top_logprobs"}
    finally:
        llm.tokenizer = saved


def test_rows_with_n_answer_every_choice_once_each_with_its_seed(llm, tmp_path):
    """`n` in a native row and in OpenAI lines: one output line with n choices, choice j the request
    with seed + j (what LLM.generate answers with SamplingParams(n=...)); a rerun after the line was lost
    redoes the row with all its choices; a row without n keeps the one-answer form (control); bad n
    values are error rows naming the field."""
    from specjax.serving.batch_job import MAX_N
    saved = llm.tokenizer
    llm.tokenizer = tiny_chat_tokenizer()
    try:
        prompt, sampled = [7, 31, 12, 40, 9], {"temperature": 1.0, "max_tokens": 6, "seed": 7}
        singles = [o.token_ids for o in llm.generate([prompt] * 3, [SamplingParams(**{**sampled, "seed": 7 + j})
                                                                     for j in range(3)])]
        assert len({tuple(s) for s in singles}) > 1  # the seeds give different answers: copies would fail
        api = llm.generate([prompt], SamplingParams(n=3, **sampled))
        assert [o.token_ids for o in api] == singles and [o.index for o in api] == [0, 1, 2]
        chat = {"messages": [{"role": "user", "content": "w5 w6"}], "n": 2, **sampled}
        rows = [{"id": "s", "prompt": prompt, "n": 3, **sampled, "metadata": {"k": 1}},
                {"id": "one", "prompt": prompt, **sampled},
                {"id": "n1", "prompt": prompt, "n": 1, **sampled},
                {"custom_id": "c", "url": "/v1/chat/completions", "body": chat},
                {"id": "zero", "prompt": prompt, "n": 0},
                {"id": "text", "prompt": prompt, "n": "2"},
                {"id": "huge", "prompt": prompt, "n": MAX_N + 1},
                {"custom_id": "oz", "url": "/v1/completions", "body": {"prompt": prompt, "n": -1}}]
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        write_jsonl(inp, rows)
        s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
        assert (s.completed, s.errors, s.requests) == (4, 4, 3 + 1 + 1 + 2)
        by = {r.get("custom_id", r.get("id")): r for r in read_jsonl(out)}
        rec = by["s"]
        assert [c["index"] for c in rec["choices"]] == [0, 1, 2] and rec["metadata"] == {"k": 1}
        assert [c["token_ids"] for c in rec["choices"]] == singles
        assert rec["completion_tokens"] == sum(c["completion_tokens"] for c in rec["choices"]) == sum(map(len, singles))
        assert rec["prompt_tokens"] == len(prompt)
        assert rec["metrics"]["num_rounds"] == sum(c["metrics"]["num_rounds"] for c in rec["choices"])
        assert "choices" not in by["one"] and by["one"]["token_ids"] == singles[0]
        assert [c["token_ids"] for c in by["n1"]["choices"]] == singles[:1]
        body = by["c"]["response"]["body"]
        (c_ref,) = llm.chat(chat["messages"], SamplingParams(**{**sampled, "seed": 8}))
        assert [c["index"] for c in body["choices"]] == [0, 1] and body["choices"][1]["token_ids"] == c_ref.token_ids
        assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
        errs = {e["id"]: e for e in read_jsonl(default_errors_path(str(out)))}
        assert {k: e["field"] for k, e in errs.items()} == {"zero": "n", "text": "n", "huge": "n", "oz": "body.n"}
        assert str(MAX_N) in errs["huge"]["error"]
        # the row's line lost: the rerun answers it again, every choice, once
        lines = [ln for ln in out.read_text().splitlines(keepends=True) if json.loads(ln).get("id") != "s"]
        out.write_text("".join(lines))
        s2 = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
        assert (s2.completed, s2.requests) == (1, 3)
        assert [c["token_ids"] for c in read_jsonl(out)[-1]["choices"]] == singles
    finally:
        llm.tokenizer = saved


def test_llm_generate_n_outputs_per_prompt_in_prompt_order(llm):
    """SamplingParams(n): n outputs a prompt in a row, greedy ones equal."""
    outs = llm.generate([[9, 8, 7, 6, 5, 4, 3, 2, 9, 8, 7, 6, 5, 4, 3, 2, 9, 8], [4, 5]],
                        SamplingParams(n=2, temperature=0, max_tokens=4))
    assert [o.index for o in outs] == [0, 1, 0, 1]
    assert outs[0].token_ids == outs[1].token_ids and outs[2].token_ids == outs[3].token_ids
    assert outs[0].prompt_token_ids != outs[2].prompt_token_ids
    with pytest.raises(ValueError, match="n must be a positive int"):
        SamplingParams(n=0)


def test_a_rows_cached_prompt_tokens_count_its_prompt_once(llm, tmp_path):
    """A row's n answers of one fresh prompt: the later ones copy the first one's prompt rows (prefix
    caching), but usage counts the prompt once, so cached_tokens is the first answer's (0 here), never
    more than prompt_tokens (the sum over answers would be 2 x 35)."""
    prompt = [11, 3, 29, 47, 8, 15, 22, 6] * 4 + [13, 2, 40, 19]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [{"id": "p", "prompt": prompt, "n": 3, "temperature": 0, "max_tokens": 3}])
    s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False, prompt_tokens_details=True)
    (rec,) = read_jsonl(out)
    assert rec["prompt_tokens"] == 36 and rec["prompt_tokens_details"] == {"cached_tokens": 0}
    assert s.metrics["tokens"]["prefix_cache_hits"] == 2 * 35  # the copies did happen


def test_torn_last_line_is_cut_and_redone(llm, tmp_path):
    rows = [{"id": i, "prompt": _prompt(i), "max_tokens": 4, "temperature": 0} for i in range(6)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
    full = out.read_bytes().splitlines(keepends=True)
    assert len(full) == 6
    out.write_bytes(b"".join(full[:3]) + full[3][: len(full[3]) // 2])  # as if killed mid-write
    s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), progress=False)
    assert (s.skipped_done, s.completed) == (3, 3)
    assert out.read_bytes().endswith(b"\n")
    assert sorted(_ids(read_jsonl(out))) == list(range(6))  # int ids keep their type


def test_shards_split_rows_and_write_their_own_files(llm, tmp_path):
    rows = [{"id": f"s{i}", "prompt": _prompt(i), "max_tokens": 2} for i in range(7)]
    rows.append({"id": "s0", "prompt": [4, 5]})  # line 8 (index 7: shard 1) repeats shard 0's id
    inp, out = tmp_path / "in.jsonl", tmp_path / "res.jsonl"
    write_jsonl(inp, rows)
    got = []
    for i in range(2):
        s = run_batch_job(llm, str(inp), str(out), shard=Shard(i, 2), progress=False)
        assert s.output_path == shard_output_path(str(out), Shard(i, 2)) == str(tmp_path / f"res.shard-{i}-of-2.jsonl")
        got.append(_ids(read_jsonl(s.output_path)))
    assert sorted(got[0]) == ["s0", "s2", "s4", "s6"] and sorted(got[1]) == ["s1", "s3", "s5"]
    assert not out.exists()
    errs = read_jsonl(tmp_path / "res.shard-1-of-2.errors.jsonl")
    assert [(e["line"], e["id"]) for e in errs] == [(8, "s0")] and "duplicate" in errs[0]["error"]
    with pytest.raises(ValueError, match="shard"):
        Shard.parse("2/2")


def test_kill_9_mid_run_then_rerun_loses_and_duplicates_nothing(llm, tmp_path):
    target = export_tiny_target(tmp_path / "target")
    n = 60
    rows = [{"id": f"k{i}", "prompt": _prompt(i)} for i in range(n)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, rows)
    cmd = [sys.executable, "-m", "serve.batch", str(inp), "-o", str(out), "--target", str(target),
           "--max-num-seqs", "2", "--max-model-len", "128", "--max-prefill", "32", "--slots-buckets", "2",
           "--tokens-buckets", "1", "--prefill-buckets", "32", "--max-tokens", "48", "--temperature", "0",
           "--no-progress"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    log = open(tmp_path / "stderr.txt", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 2:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-3000:]
    partial = out.read_bytes().count(b"\n")
    assert 2 <= partial < n, "the kill should land mid-run"
    s = run_batch_job(llm, str(inp), str(out), shard=Shard(0, 1), defaults=SamplingParams(max_tokens=48, temperature=0),
                      progress=False)
    assert s.skipped_done == partial and s.completed == n - partial
    final = read_jsonl(out)
    assert sorted(_ids(final)) == sorted(f"k{i}" for i in range(n))  # every id exactly once
    assert all(r["finish_reason"] in ("stop", "length") and r["token_ids"] for r in final)
    assert not os.path.exists(default_errors_path(str(out))) or read_jsonl(default_errors_path(str(out))) == []


def test_program_defaults_reach_the_job(monkeypatch, tmp_path):
    """serve.batch's default sampling flags (--ignore-eos among them) become the job's defaults."""
    from specjax.cli import batch as batch_cli
    from specjax.serving import batch_job
    seen = {}
    monkeypatch.setattr(batch_cli, "build_llm", lambda args, progress=False: "llm")
    monkeypatch.setattr(batch_job, "run_batch_job",
                        lambda llm, inp, out, **kw: seen.update(kw) or type("S", (), {"as_dict": lambda self: {}})())
    argv = [str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--no-progress", "--distributed", "off"]
    assert batch_cli.main(argv + ["--ignore-eos", "--max-tokens", "7"]) == 0
    assert seen["defaults"] == SamplingParams(max_tokens=7, ignore_eos=True)
    batch_cli.main(argv)
    assert seen["defaults"].ignore_eos is False


def test_an_openai_lines_guide_is_named_by_the_body_field_that_set_it():
    """A guide a batch line asked for through response_format or tool_choice is named by that field
    (schema.guide_source, as the server names it), not by the SamplingParams field it became."""
    from specjax.api import SamplingParams
    from specjax.serving.batch_job import parse_row
    chat = {"messages": [{"role": "user", "content": "x"}]}
    lines = {"response_format": {**chat, "response_format": {"type": "json_object"}},
             "tool_choice": {**chat, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
             "guided_json": {**chat, "guided_json": {"type": "object"}}}
    for field, body in lines.items():
        row = parse_row({"custom_id": "a", "url": "/v1/chat/completions", "body": body}, 1, SamplingParams())
        assert (row.field("guided_json"), row.field("temperature")) == (f"body.{field}", "body.temperature")
