"""train.regenerate / specjax.training.regenerate: multi-turn replay, ordered writes, error rows,
resume after kill -9 (no duplicate, no gap, input order)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

# Six rows: two-turn chat, a conversation with a system prompt and an original answer (dropped),
# a malformed JSON line, a completion prompt, an explicit integer id, a row without id.
ROWS = [
    json.dumps({"id": "a", "turns": ["w10 w11 w12", "w13 w14"]}),
    json.dumps({"conversations": [{"role": "system", "content": "w20"}, {"role": "user", "content": "w21 w22"},
                                  {"role": "assistant", "content": "w30 w31"}, {"role": "user", "content": "w23"}]}),
    '{"turns": ["w7"',
    json.dumps({"prompt": "w40 w41 w42"}),
    json.dumps({"id": 7, "turns": ["w50", "w51 w52"]}),
    json.dumps({"turns": ["w15 w16", "w17"]}),
]
EXPECTED_IDS = ["a", 1, 3, 7, 5]
TEMPLATE = ("{% for m in messages %}"
            "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system message not first') }}{% endif %}"
            "{{ 'w4' if m['role'] == 'user' else ('w6' if m['role'] == 'system' else 'w5') }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}")


def make_target_dir(root: pathlib.Path) -> pathlib.Path:
    """A tiny random Qwen3 target (vocab 64) + a word-level tokenizer with a chat template."""
    from serving_fixtures import export_tiny_target, tiny_chat_tokenizer

    d = export_tiny_target(root / "target")
    tok = tiny_chat_tokenizer()  # word level: "<unk>", "<s>", "</s>" (eos), "w3".."w63"
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


def read_jsonl(path) -> list[dict]:
    p = pathlib.Path(path)
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> pathlib.Path:
    return make_target_dir(tmp_path_factory.mktemp("regen"))


@pytest.fixture(scope="module")
def llm(target_dir):
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig

    cfg = EngineConfig(max_slots=2, max_len=128, policy="plain", max_prefill=32, slots_buckets=(2,),
                       prefill_buckets=(32,), prefill_batch_buckets=(2,))
    return LLM(target=str(target_dir), engine_config=cfg)


def _write(path: pathlib.Path, rows: list[str]) -> pathlib.Path:
    path.write_text("\n".join(rows) + "\n")
    return path



def _sp():
    import dataclasses

    from specjax.training.regenerate import QWEN3_DEFAULTS
    return dataclasses.replace(QWEN3_DEFAULTS, max_tokens=12)


def test_defaults_are_qwen3_non_thinking():
    from specjax.training.regenerate import QWEN3_DEFAULTS
    assert (QWEN3_DEFAULTS.temperature, QWEN3_DEFAULTS.top_p, QWEN3_DEFAULTS.top_k, QWEN3_DEFAULTS.max_tokens) == \
        (0.7, 0.8, 20, 4096)


def test_parse_rows():
    from specjax.training.regenerate import RowError, parse_row

    it = parse_row(json.loads(ROWS[1]), 1, 2)
    assert it.id == 1 and it.kind == "chat"
    assert [m["role"] for m in it.pending] == ["system", "user", "user"]  # the original answer is dropped
    sharegpt = parse_row({"conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w4"}]}, 0, 1)
    assert sharegpt.pending == [{"role": "user", "content": "w3"}]
    assert parse_row({"id": "x", "prompt": "w3"}, 4, 5).kind == "completion"
    for bad, field in [({"turns": []}, "turns"), ({"turns": ["ok", 3]}, "turns[1]"), ({"prompt": ""}, "prompt"),
                       ({"conversations": [{"role": "assistant", "content": "w3"}]}, "no user turn"),
                       ({"conversations": [{"role": "robot", "content": "w3"}]}, "role"),
                       ({"turns": ["w3"], "prompt": "w3"}, "exactly one"), ({"id": True, "turns": ["w3"]}, "id"),
                       ([1, 2], "JSON object")]:
        with pytest.raises(RowError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_row(bad, 0, 1)


def test_regenerate_orders_rows_replays_turns_and_reports_errors(llm, tmp_path):
    from specjax.training.regenerate import regenerate

    src = _write(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    s = regenerate(llm, str(src), str(out), sampling=_sp(), seed=3, progress=False)
    assert (s.completed, s.errors, s.rows) == (5, 1, 6)
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == EXPECTED_IDS
    errs = read_jsonl(tmp_path / "out.errors.jsonl")
    assert len(errs) == 1 and errs[0]["line"] == 3 and errs[0]["index"] == 2 and "malformed JSON" in errs[0]["error"]

    a = rows[0]["conversations"]
    assert [m["role"] for m in a] == ["user", "assistant", "user", "assistant"]
    assert [a[0]["content"], a[2]["content"]] == ["w10 w11 w12", "w13 w14"]
    conv = rows[1]["conversations"]
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert conv[0]["content"] == "w20" and conv[3]["content"] == "w23"
    assert rows[2] == {"id": 3, "prompt": "w40 w41 w42", "completion": rows[2]["completion"]}
    assert isinstance(rows[2]["completion"], str)
    # every reply is real generated text over the tokenizer's words (at most max_tokens words)
    replies = [m["content"] for r in rows if "conversations" in r
               for m in r["conversations"] if m["role"] == "assistant"]
    assert len(replies) == 8 and sum(len(x.split()) for x in replies) > 0
    assert all(len(x.split()) <= 12 and all(w.startswith("w") for w in x.split()) for x in replies)
    assert s.requests == 9 and s.generated_tokens >= sum(len(x.split()) for x in replies)

    # seeds come from (seed, row, turn): one row at a time (window 1) gives the same rows; another seed differs
    out1 = tmp_path / "out_w1.jsonl"
    regenerate(llm, str(src), str(out1), sampling=_sp(), seed=3, window=1, progress=False)
    assert read_jsonl(out1) == rows
    out2 = tmp_path / "out_s4.jsonl"
    regenerate(llm, str(src), str(out2), sampling=_sp(), seed=4, progress=False)
    assert read_jsonl(out2) != rows and [r["id"] for r in read_jsonl(out2)] == EXPECTED_IDS


def test_resume_in_process_and_refuse_a_different_input(llm, tmp_path):
    from specjax.training.regenerate import regenerate

    src = _write(tmp_path / "prompts.jsonl", ROWS)
    full = tmp_path / "full.jsonl"
    regenerate(llm, str(src), str(full), sampling=_sp(), seed=5, progress=False)
    part = tmp_path / "part.jsonl"
    s1 = regenerate(llm, str(src), str(part), sampling=_sp(), seed=5, limit=3, progress=False)
    assert s1.completed + s1.errors == 3 and len(read_jsonl(part)) == 2
    with open(part, "a") as f:  # a torn last line, as a kill -9 in the middle of a write leaves it
        f.write('{"id": 3, "prompt": "w40 w4')
    s2 = regenerate(llm, str(src), str(part), sampling=_sp(), seed=5, progress=False)
    assert s2.skipped_done == 3 and s2.completed + s2.errors == 3
    assert read_jsonl(part) == read_jsonl(full)
    assert read_jsonl(tmp_path / "part.errors.jsonl") == read_jsonl(tmp_path / "full.errors.jsonl")
    # a finished job is a no-op
    s3 = regenerate(llm, str(src), str(part), sampling=_sp(), seed=5, progress=False)
    assert s3.completed + s3.errors == 0 and read_jsonl(part) == read_jsonl(full)
    # the output does not belong to this input: refuse instead of appending
    other = _write(tmp_path / "other.jsonl", [json.dumps({"id": "zz", "turns": ["w3"]})] + ROWS[1:])
    with pytest.raises(ValueError, match="does not continue"):
        regenerate(llm, str(other), str(part), sampling=_sp(), seed=5, progress=False)


def test_too_long_row_goes_to_errors_and_the_job_goes_on(llm, tmp_path):
    from specjax.training.regenerate import regenerate

    long_turn = " ".join(f"w{3 + i % 60}" for i in range(200))  # > max_model_len 128
    late_system = {"conversations": [{"role": "user", "content": "w3"}, {"role": "system", "content": "w4"},
                                     {"role": "user", "content": "w5"}]}  # the template refuses turn 2
    src = _write(tmp_path / "p.jsonl", [json.dumps({"turns": [long_turn]}), json.dumps({"turns": ["w8"]}),
                                        json.dumps({"turns": []}), json.dumps(late_system),
                                        json.dumps({"prompt": "w9"})])
    out = tmp_path / "o.jsonl"
    s = regenerate(llm, str(src), str(out), sampling=_sp(), progress=False)
    assert [r["id"] for r in read_jsonl(out)] == [1, 4]
    errs = read_jsonl(tmp_path / "o.errors.jsonl")
    assert [e["line"] for e in errs] == [1, 3, 4]
    assert "max_model_len 128" in errs[0]["error"] and "turns" in errs[1]["error"]
    assert "system message not first" in errs[2]["error"]
    assert (s.completed, s.errors) == (2, 3)


def _cli(target: pathlib.Path, src: pathlib.Path, out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "train.regenerate", "--target", str(target), "--prompts", str(src),
            "--out", str(out), "--max-num-seqs", "1", "--max-model-len", "512", "--max-prefill", "16",
            "--max-tokens", "120", "--seed", "11", "--quiet"]


def _env(cache: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device is all the job uses
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),  # the rerun skips recompiling
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               TOKENIZERS_PARALLELISM="false")
    return env


def _lines(path: pathlib.Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_kill_9_then_rerun_leaves_no_duplicate_and_no_gap(target_dir, tmp_path):
    src = _write(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    errs = tmp_path / "out.errors.jsonl"
    cache = tmp_path / "jax_cache"
    cmd, env = _cli(target_dir, src, out), _env(cache)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while _lines(out) < 2:
            assert proc.poll() is None, f"job ended before it could be killed: {proc.communicate()[1].decode()[-2000:]}"
            assert time.monotonic() < deadline, "no output after 120 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    at_kill = _lines(out)
    assert 2 <= at_kill < len(EXPECTED_IDS), f"the kill came after the job finished ({at_kill} rows)"
    first = out.read_bytes()

    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=180)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    summary = json.loads(res.stdout.decode().strip().splitlines()[-1])
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == EXPECTED_IDS  # no duplicate, no gap, input order
    assert out.read_bytes().startswith(first[: first.rfind(b"\n") + 1])  # earlier rows untouched
    e = read_jsonl(errs)
    assert [x["line"] for x in e] == [3]
    assert summary["skipped_done"] + summary["completed"] + summary["errors"] == len(ROWS)
    assert summary["skipped_done"] >= 2
    for r in rows:
        if "conversations" in r:
            roles = [m["role"] for m in r["conversations"]]
            assert roles[-1] == "assistant" and roles.count("assistant") == roles.count("user")


def test_shards_split_rows_resume_and_together_equal_one_process(llm, tmp_path):
    from specjax.jobs import Shard
    from specjax.training.regenerate import regenerate

    src = _write(tmp_path / "prompts.jsonl", ROWS)
    whole = regenerate(llm, str(src), str(tmp_path / "one.jsonl"), sampling=_sp(), seed=3,
                       shard=Shard(0, 1), progress=False)
    assert whole.output_path == str(tmp_path / "one.jsonl")
    out = tmp_path / "out.jsonl"
    # shard 1 of 2 stops after one row, then resumes
    first = regenerate(llm, str(src), str(out), sampling=_sp(), seed=3, shard=Shard(1, 2), limit=1,
                       progress=False)
    assert (first.shard, first.rows, first.completed, first.errors) == ("1/2", 3, 1, 0)
    rest = regenerate(llm, str(src), str(out), sampling=_sp(), seed=3, shard=Shard(1, 2), progress=False)
    assert (rest.skipped_done, rest.completed, rest.errors) == (1, 2, 0)
    zero = regenerate(llm, str(src), str(out), sampling=_sp(), seed=3, shard=Shard(0, 2), progress=False)
    assert (zero.shard, zero.completed, zero.errors) == ("0/2", 2, 1)  # row 2 is the malformed line
    assert not out.exists()
    parts = [read_jsonl(tmp_path / f"out.shard-{i}-of-2.jsonl") for i in range(2)]
    assert [r["id"] for r in parts[0]] == ["a", 7] and [r["id"] for r in parts[1]] == [1, 3, 5]
    errs = read_jsonl(tmp_path / "out.shard-0-of-2.errors.jsonl")
    assert [(e["index"], e["line"]) for e in errs] == [(2, 3)]
    # row seeds are global: the shards hold exactly the rows one process wrote
    by_id = {r["id"]: r for r in read_jsonl(tmp_path / "one.jsonl")}
    assert sorted(map(str, by_id)) == sorted(str(r["id"]) for p in parts for r in p)
    for p in parts:
        for r in p:
            assert r == by_id[r["id"]]
    # a shard file is checked against its own rows on resume: shard 1's file as shard 0's output
    import shutil

    (tmp_path / "wrong").mkdir()
    shutil.copy(tmp_path / "out.shard-1-of-2.jsonl", tmp_path / "wrong" / "x.shard-0-of-2.jsonl")
    with pytest.raises(ValueError, match="does not continue"):
        regenerate(llm, str(src), str(tmp_path / "wrong" / "x.jsonl"), sampling=_sp(), seed=3,
                   shard=Shard(0, 2), progress=False)


class _RecordingLLM:
    """The LLM, with every request's prompt ids recorded."""

    def __init__(self, llm):
        self._llm, self.prompts = llm, []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def make_request(self, ids, sp, request_id=None):
        self.prompts.append((request_id, list(ids)))
        return self._llm.make_request(ids, sp, request_id=request_id)


def test_multi_turn_answers_each_turn_on_the_targets_own_earlier_answers(llm, tmp_path):
    """Turn 2's prompt holds the target's own turn-1 answer, never the conversation's original
    one; a later turn that leaves no room in the context ends the conversation after the answers
    it has (the row is not lost)."""
    from specjax.request_builder import encode_chat
    from specjax.training.regenerate import regenerate

    original = "w60 w60 w60 w60 w60 w60"
    long_turn = " ".join(f"w{3 + i % 60}" for i in range(200))  # > max_model_len 128
    src = _write(tmp_path / "p.jsonl", [
        json.dumps({"id": "m", "conversations": [
            {"from": "human", "value": "w10 w11"}, {"from": "gpt", "value": original},
            {"from": "human", "value": "w13 w14"}, {"from": "gpt", "value": original}]}),
        json.dumps({"id": "full", "turns": ["w20", long_turn]})])
    rec = _RecordingLLM(llm)
    out = tmp_path / "out.jsonl"
    s = regenerate(rec, str(src), str(out), sampling=_sp(), seed=1, progress=False)
    assert (s.completed, s.errors) == (2, 0)
    rows = read_jsonl(out)
    conv = rows[0]["conversations"]
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
    own = conv[1]["content"]
    assert own and own != original
    tok = llm.tokenizer
    turn2 = dict(rec.prompts)["0:1"]
    assert turn2 == encode_chat(tok, conv[:3], enable_thinking=False)
    theirs = [conv[0], {"role": "assistant", "content": original}, conv[2]]
    assert turn2 != encode_chat(tok, theirs, enable_thinking=False)  # negative control
    text = tok.decode(turn2, skip_special_tokens=True)
    assert own in text and original not in text and "w13 w14" in text
    # the second row: turn 2 does not fit, so the row is its first exchange
    assert [m["role"] for m in rows[1]["conversations"]] == ["user", "assistant"]


def test_serving_defaults_bf16_on_accelerators_and_context_from_the_data(target_dir, tmp_path, monkeypatch):
    """train.regenerate without --dtype / --max-model-len: float32 on CPU (bfloat16 on an
    accelerator) and the longest request the prompts can make, rounded up; the flags override."""
    import jax

    from specjax import api, checkpoints
    from specjax.request_builder import encode_chat
    from specjax.training.regenerate import data_max_len, default_dtype
    from train import regenerate as cli

    assert default_dtype() == "float32"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert default_dtype() == "bfloat16"
    monkeypatch.undo()

    src = _write(tmp_path / "prompts.jsonl", ROWS)
    tok = checkpoints.load_tokenizer(target_dir)
    # row "a": two user turns, the first answered (an empty assistant turn stands for the answer)
    row_a = len(encode_chat(tok, [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": ""},
                                  {"role": "user", "content": "w13 w14"}]))
    assert data_max_len(tok, str(src), 100, limit=8192, multiple=1) == row_a + 2 * 100  # the longest row
    assert data_max_len(tok, str(src), 100, limit=8192) == 256  # rounded up to 128
    assert data_max_len(tok, str(src), 100, limit=200) == 200  # capped at the model's maximum

    class Built(Exception):
        pass

    seen = {}

    def fake_llm(**kw):
        seen.update(kw)
        raise Built

    monkeypatch.setattr(api, "LLM", fake_llm)
    base = ["--target", str(target_dir), "--prompts", str(src), "--out", str(tmp_path / "o.jsonl"),
            "--max-tokens", "100"]
    with pytest.raises(Built):
        cli.main(base)
    assert (seen["max_model_len"], seen["dtype"]) == (256, "float32")
    with pytest.raises(Built):
        cli.main(base + ["--max-model-len", "512", "--dtype", "bfloat16"])
    assert (seen["max_model_len"], seen["dtype"]) == (512, "bfloat16")


def test_the_build_regenerates_with_the_serving_defaults(tmp_path):
    """The build's regeneration step leaves the dtype to train.regenerate's default (bfloat16 on an
    accelerator) and bounds the context by its data: longest prompt kept + answer + template."""
    import types

    from specjax.training.build_plan import SCALES, BuildSettings
    from train.build_stages import ProgramStages

    s = BuildSettings(target="t", out_dir=str(tmp_path / "o"), work_dir=str(tmp_path / "w"),
                      config_dir=str(tmp_path), drafters=("d",), eval_dir=str(tmp_path), scale=SCALES["smoke"])
    steps = []
    ProgramStages(lambda st: steps.append(st) or 0).regenerate(types.SimpleNamespace(s=s, budget=None,
                                                                                     log=lambda m: None))
    args = steps[0].args
    assert steps[0].module == "train.regenerate" and "--dtype" not in args
    assert int(args[args.index("--max-model-len") + 1]) == s.max_length == 128 + 32 + 64
