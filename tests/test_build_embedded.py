"""train.build_embedded / specjax.training.build end to end at a tiny scale on a tiny random Llama
target: ShareGPT JSON -> prompts -> regenerated answers -> offline cache -> draft vocabulary ->
dspark (cache, Markov + confidence heads, draft vocabulary) and mtp1 (online) -> STS -> export;
the exports load with the registry, BUILD.json records every stage, and stages resume. The build
adds 3 original ShareGPT replies (`--reference-rows`) as a second cache / training file.
The pipeline test takes ~100 s on an idle 2-core machine (most of it compiling the engine for
regeneration and calibration and the two training steps); it runs every stage once, in process.)"""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

WORDS = [f"w{i}" for i in range(10, 64)]
EVAL_PROMPT = "w20 w21 w22 w23"


def _tiny_llama_target(root: pathlib.Path) -> pathlib.Path:
    """A random 2-layer Llama (tied, vocab 64) exported with a chat-template word tokenizer."""
    from flax import nnx

    from serving_fixtures import TINY, tiny_chat_tokenizer
    from specjax import checkpoints
    from specjax.config import TargetConfig
    from specjax.models.decoder import CausalLM

    cfg = TargetConfig(**TINY, architecture="LlamaForCausalLM", model_type="llama", qk_norm=False,
                       tie_word_embeddings=True, eos_token_ids=(2,), bos_token_id=1,
                       max_position_embeddings=512)
    d = root / "target"
    checkpoints.export_target(CausalLM(cfg, rngs=nnx.Rngs(0)), cfg, d)
    tiny_chat_tokenizer().save_pretrained(d)
    return d


def _sharegpt(root: pathlib.Path, n: int = 24) -> pathlib.Path:
    """n conversations of 3-8 words (one is an evaluation prompt, one a duplicate) cut off inside
    a last record, as the real file is."""
    import random

    rng = random.Random(0)
    recs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))},
        {"from": "gpt", "value": "w30 w31"}]} for i in range(n)]
    recs[3]["conversations"][0]["value"] = EVAL_PROMPT
    recs[5]["conversations"][0]["value"] = recs[4]["conversations"][0]["value"]
    text = json.dumps(recs)
    path = root / "sharegpt.json"
    path.write_text(text[: text.rfind("{\"id\"") + 30])  # the last record is truncated
    return path


def _configs(root: pathlib.Path) -> pathlib.Path:
    common = {"optimizer": {"learning_rate": 0.003, "warmup_ratio": 0.0},
              "schedule": {"total_steps": 1000},  # the build's --steps overrides it
              "checkpoint": {"directory": "unused", "save_every": 2, "keep": 1,
                             "async_save": False},
              "logging": {"directory": "unused", "every": 1, "tensorboard": False,
                          "progress": False}}
    dspark = {"name": "tiny_dspark", "model": {
        "kind": "dspark", "target": "unused", "mask_token_id": 3, "target_layer_ids": [0, 1],
        "num_draft_layers": 1, "block_size": 4, "markov_rank": 8, "confidence_head": True,
        "num_anchors": 8, "draft_vocab_size": 48, "compute_dtype": "float32",
        "target_dtype": "float32"},
        "data": {"mode": "cache", "cache_dir": "unused", "max_length": 64, "min_loss_tokens": 2,
                 "batch_size": 4, "length_buckets": [64]}, **common}
    mtp = {"name": "tiny_mtp", "model": {"kind": "mtp", "target": "unused",
                                         "compute_dtype": "float32", "target_dtype": "float32"},
           "data": {"mode": "online", "train_jsonl": ["unused"], "max_length": 64,
                    "min_loss_tokens": 2, "batch_size": 4, "length_buckets": [64]}, **common}
    d = root / "configs"
    d.mkdir()
    (d / "dspark.yaml").write_text(yaml.safe_dump(dspark))
    (d / "mtp1.yaml").write_text(yaml.safe_dump(mtp))
    return d


def build_inputs(root: pathlib.Path, sharegpt: pathlib.Path) -> dict:
    """A build's inputs under `root`: the tiny target, `sharegpt`, the drafter configs and an
    evaluation directory with one Table 1 set."""
    eval_dir = root / "eval"
    eval_dir.mkdir()
    (eval_dir / "set.jsonl").write_text(json.dumps({"turns": [EVAL_PROMPT]}) + "\n")
    (eval_dir / "gsm8k.jsonl").write_text(json.dumps({"turns": [EVAL_PROMPT]}) + "\n")  # a Table 1 set
    return {"root": root, "target": _tiny_llama_target(root), "sharegpt": sharegpt,
            "configs": _configs(root), "eval": eval_dir}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    return build_inputs(root, _sharegpt(root))


def _argv(s, *extra: str) -> list[str]:
    r = s["root"]
    return ["--in-process", "--target", str(s["target"]), "--out-dir", str(r / "out"),
            "--work-dir", str(r / "work"), "--config-dir", str(s["configs"]),
            "--eval-dir", str(s["eval"]), "--sharegpt", str(s["sharegpt"]),
            "--drafters", "dspark", "mtp1", "--scale", "smoke", "--rows", "6",
            "--max-new-tokens", "12", "--prompt-max-tokens", "16", "--steps", "3",
            "--calibrate-prompts", "2", "--calibrate-tokens", "6", "--heldout-fraction", "0.25",
            "--regen-slots", "1", "--reference-rows", "3", *extra]


def test_pipeline_end_to_end_resumes_and_exports_loadable_drafters(setup, capsys):
    from specjax import checkpoints
    from specjax.drafters import registry
    from specjax.io import read_jsonl
    from train import build_embedded

    s, work, out = setup, setup["root"] / "work", setup["root"] / "out"
    assert build_embedded.main(_argv(s, "--stages", "prepare", "regenerate")) == 0
    regen = work / "regen.jsonl"
    rows = read_jsonl(regen)
    assert len(rows) == 6 and all(r["conversations"][-1]["role"] == "assistant" for r in rows)
    man = json.loads((work / "sharegpt" / "manifest.json").read_text())
    assert man["read"]["finished"] is False  # the truncated last record was noticed, not fatal
    assert man["prompts"]["dropped"].get("evaluation prompt") == 1
    assert man["prompts"]["dropped"].get("duplicate") == 1

    # resume by record: drop the last two answers; a rerun writes exactly those again
    lines = regen.read_text().splitlines(keepends=True)
    regen.write_text("".join(lines[:4]))
    assert build_embedded.main(_argv(s, "--stages", "regenerate")) == 0
    assert [r["id"] for r in read_jsonl(regen)] == [r["id"] for r in rows]
    # complete: a third run does nothing (file untouched, stage skipped)
    mtime = regen.stat().st_mtime_ns
    record = json.loads((out / "BUILD.json").read_text())
    assert record["stages"]["regenerate"]["runs"] == 2
    assert build_embedded.main(_argv(s, "--stages", "regenerate")) == 0
    assert regen.stat().st_mtime_ns == mtime
    assert json.loads((out / "BUILD.json").read_text())["stages"]["regenerate"]["runs"] == 2

    # fewer rows than already answered is refused (the file may only grow)
    assert build_embedded.main(_argv(s, "--stages", "regenerate", "--rows", "5")) == 1

    capsys.readouterr()
    assert build_embedded.main(_argv(s)) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "BUILD.json").read_text())
    for key in ("prepare", "regenerate", "cache", "cache/references", "vocab", "train/dspark",
                "train/mtp1", "calibrate/dspark", "export"):
        runs = 3 if key == "regenerate" else 1  # regenerate: the run, its resume, the refusal
        assert record["stages"][key]["complete"] and record["stages"][key]["runs"] == runs, key
    assert "calibrate/mtp1" not in record["stages"]  # no confidence head
    # the original replies: the 3 training prompts after the regenerated ones, cached on their own
    # and read by every drafter after the regenerated answers
    train_ids = [r["id"] for r in read_jsonl(work / "sharegpt" / "prompts.jsonl")]
    refs = read_jsonl(work / "references_3.jsonl")
    assert [r["id"] for r in refs] == train_ids[6:9] and record["data"]["reference_rows"] == 3
    assert all(r["conversations"][1] == {"role": "assistant", "content": "w30 w31"} for r in refs)
    n_cached = [json.loads((work / d / "manifest.json").read_text())["num_samples"]
                for d in ("cache", "cache_references_3")]
    assert n_cached[1] == 3
    started = {d["run"]: d for d in (json.loads(x) for x in printed.splitlines()
                                     if x.startswith('{"run"'))}
    assert started["tiny_dspark"]["samples"] == sum(n_cached)
    assert 0 < record["data"]["draft_vocab_coverage"]["48"] <= 1.0
    assert record["drafter_bytes_total"] == sum(record["drafter_bytes"].values()) > 0

    target, tcfg = checkpoints.load_target(s["target"])
    for name in ("dspark", "mtp1"):
        d = out / "drafters" / name
        registry.load_drafter(d, target=target)
        info = json.loads((d / "training.json").read_text())
        assert info["final_step"] == 3 and str(s["root"]) not in json.dumps(info)
        if name == "dspark":  # the smoke scale's learning curve, at the run's end (3 steps)
            assert [p["step"] for p in info["learning_curve"]] == [3]
            assert set(info["learning_curve"][0]["sets"]) == {"train", "heldout", "table1"}
        else:
            assert "learning_curve" not in info
        data = info["train_config"]["data"]
        if name == "dspark":
            assert (data["cache_dir"], data["extra_cache_dirs"]) == (
                "<work>/cache", ["<work>/cache_references_3"])
        else:
            assert data["train_jsonl"] == ["<work>/regen.jsonl", "<work>/references_3.jsonl"]
    # the shipped copy leaves out the target's embedding and head copies and loads the same
    import jax
    import numpy as np
    from flax import nnx

    with checkpoints.SafetensorsDir(out / "drafters" / "dspark") as r:
        assert "embed_tokens.weight" not in r and "lm_head.weight" not in r and "fc.weight" in r
    with checkpoints.SafetensorsDir(work / "exports" / "dspark") as r:
        assert "embed_tokens.weight" in r  # negative control: the trainer's full export has it
    dspark = registry.load_drafter(out / "drafters" / "dspark", target=target)
    full = registry.load_drafter(work / "exports" / "dspark", target=target)
    trained = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (dspark, full)]
    assert len(trained[0]) == len(trained[1]) > 5
    for a, b in zip(*trained):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the frozen copies come from the target itself (exact; the full export rounded them to bf16)
    np.testing.assert_array_equal(np.asarray(dspark.embed_tokens.embedding[...]),
                                  np.asarray(target.model.embed_tokens.embedding[...]))
    assert dspark.draft_vocab.size == 48
    assert (out / "drafters" / "dspark" / "calibration.json").is_file()
    assert "confidence_temperatures" in json.loads((out / "drafters" / "dspark" /
                                                    "config.json").read_text())
    # the recorded split keeps evaluation prompts out and ships the held-out prompts
    split = json.loads((out / "split.json").read_text())
    held = read_jsonl(out / "prompts" / "heldout.jsonl")
    assert held and [r["id"] for r in held] == split["heldout_ids"]
    train_prompts = {r["turns"][0] for r in read_jsonl(work / "sharegpt" / "prompts.jsonl")}
    assert EVAL_PROMPT not in train_prompts | {r["turns"][0] for r in held}
    from specjax.training.sharegpt import prompt_digest

    regen = read_jsonl(work / "regen_prompts.jsonl")
    assert split["train_prompt_digests"] == sorted({prompt_digest(r["turns"][0]) for r in regen})
    assert prompt_digest(EVAL_PROMPT) not in split["train_prompt_digests"]

    # a rerun of a finished build trains nothing again
    steps_before = record["stages"]["train/dspark"]["runs"]
    assert build_embedded.main(_argv(s, "--stages", "train")) == 0
    again = json.loads((out / "BUILD.json").read_text())
    assert again["stages"]["train/dspark"]["runs"] == steps_before


def test_budget_refuses_an_oversized_export(setup, capsys):
    """Negative control of the size budget: the same exports refused under a 0.01 MiB budget."""
    from train import build_embedded

    if not (setup["root"] / "work" / "exports" / "mtp1" / "config.json").is_file():
        pytest.skip("needs the pipeline test's exports")
    rc = build_embedded.main(_argv(setup, "--stages", "export", "--budget-mb", "0.01"))
    assert rc == 1 and "over the 0.01 MiB budget" in capsys.readouterr().err


def test_exporting_one_drafter_counts_the_others_already_shipped(setup, capsys):
    """A build of one drafter into an output directory that ships others: those count toward the
    budget (a budget above the one drafter but below both refuses) and stay in BUILD.json's sizes,
    drafters and cache layers."""
    from specjax.training.build_outputs import dir_bytes
    from train import build_embedded

    out = setup["root"] / "out"
    if not (out / "drafters" / "dspark" / "config.json").is_file():
        pytest.skip("needs the pipeline test's exports")
    shipped = {n: dir_bytes(str(out / "drafters" / n)) for n in ("dspark", "mtp1")}
    budget = (shipped["mtp1"] + shipped["dspark"] / 2) / 2**20
    only_mtp = ["--stages", "export", "--drafters", "mtp1"]  # the later --drafters wins
    rc = build_embedded.main(_argv(setup, *only_mtp, "--budget-mb", f"{budget:.4f}"))
    assert rc == 1 and "dspark" in capsys.readouterr().err
    assert build_embedded.main(_argv(setup, *only_mtp)) == 0
    record = json.loads((out / "BUILD.json").read_text())
    assert record["drafter_bytes"] == shipped and record["drafter_bytes_total"] == sum(shipped.values())
    assert record["settings"]["drafters"] == ["dspark", "mtp1"] and record["settings"]["cache_layers"] == [0, 1]


def test_cache_drafters_must_share_tap_layers(setup, tmp_path):
    from specjax.training import build_outputs as BO
    from specjax.training import build_plan as B
    from train import build_stages as BS

    cfgs = tmp_path / "configs"
    cfgs.mkdir()
    for name, layers in (("a", [0, 1]), ("b", [1])):
        (cfgs / f"{name}.yaml").write_text(yaml.safe_dump(
            {"model": {"kind": "dflash", "target_layer_ids": layers}, "data": {"mode": "cache"}}))
    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "o"),
                        work_dir=str(tmp_path / "w"), config_dir=str(cfgs), drafters=("a", "b"),
                        eval_dir=str(setup["eval"]), scale=B.SCALES["smoke"])
    with pytest.raises(BO.BuildError, match=r"b.yaml: model.target_layer_ids \[1\] differ"):
        BS.program_build(s, runner=lambda step: 0)
    # MTP-1 reads only the cache's final hidden state: it needs no tap layers of its own
    (cfgs / "m.yaml").write_text(yaml.safe_dump({"model": {"kind": "mtp"}, "data": {"mode": "cache"}}))
    assert BS.program_build(B.BuildSettings(**{**s.__dict__, "drafters": ("a", "m")}),
                            runner=lambda st: 0).layers == (0, 1)
    with pytest.raises(BO.BuildError, match="no training config"):
        BS.program_build(B.BuildSettings(**{**s.__dict__, "drafters": ("zzz",)}), runner=lambda st: 0)
    assert not os.path.exists(tmp_path / "o")


def test_draft_vocab_file_round_trip_and_errors(tmp_path):
    import numpy as np

    from specjax.training import build_outputs as BO

    p = str(tmp_path / "v.json")
    BO.write_draft_vocab(p, np.array([2, 5, 9]), coverage=0.5, counted_tokens=10, source="x")
    np.testing.assert_array_equal(BO.read_draft_vocab(p, size=3), [2, 5, 9])
    with pytest.raises(ValueError, match="3 draft ids, but the config's draft_vocab_size is 4"):
        BO.read_draft_vocab(p, size=4)
    (tmp_path / "bad.json").write_text('{"draft_ids": []}')
    with pytest.raises(ValueError, match="bad.json: field 'draft_ids'"):
        BO.read_draft_vocab(str(tmp_path / "bad.json"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        BO.read_draft_vocab(str(tmp_path / "none.json"))


def test_reference_rows_without_cache_drafters_still_write_the_training_file(setup, tmp_path):
    """With only online drafters there is no cache to build, but the chosen original replies must
    still be written, since those drafters read the file itself; with none to add it says so."""
    import dataclasses

    from serving_fixtures import write_jsonl
    from specjax.io import read_jsonl
    from specjax.training import build_outputs as BO
    from specjax.training import build_plan as B
    from train import build_stages as BS

    cfgs = tmp_path / "configs"
    cfgs.mkdir()
    (cfgs / "m.yaml").write_text(yaml.safe_dump({"model": {"kind": "standalone"},
                                                 "data": {"mode": "online"}}))
    work = tmp_path / "w"
    (work / "sharegpt").mkdir(parents=True)
    conv = lambda i: {"id": f"c{i}", "conversations": [{"role": "user", "content": f"q{i}"},
                                                       {"role": "assistant", "content": f"a{i}"}]}
    write_jsonl(work / "sharegpt" / "references.jsonl", [conv(i) for i in range(5)])
    write_jsonl(work / "regen_prompts.jsonl", [{"id": "c1", "turns": ["q1"]}])
    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "o"),
                        work_dir=str(work), config_dir=str(cfgs), drafters=("m",),
                        eval_dir=str(setup["eval"]),
                        scale=dataclasses.replace(B.SCALES["smoke"], reference_rows=2))
    steps = []
    b = BS.program_build(s, runner=lambda st: steps.append(st) or 0, log=lambda m: None)
    assert b.layers is None and not b.done_cache_references()
    b.run(["cache"])
    assert steps == []  # nothing to cache
    assert [r["id"] for r in read_jsonl(s.references_out)] == ["c0", "c2"]  # c1 was regenerated
    assert b.record["stages"]["cache/references"]["complete"]
    b.train(b.plans[0])
    assert any('data.train_jsonl=["' in a and "references_2.jsonl" in a for a in steps[0].args)
    write_jsonl(work / "regen_prompts.jsonl", [conv(i) | {"turns": [f"q{i}"]} for i in range(5)])
    with pytest.raises(BO.BuildError, match="no original reply to add"):
        BS.program_build(dataclasses.replace(s, scale=dataclasses.replace(s.scale, reference_rows=3)),
                         runner=lambda st: 0, log=lambda m: None).run(["cache"])


def test_every_embedded_config_is_a_shipped_drafters_and_loads():
    """configs/embedded holds exactly the shipped drafters' training configs (experiments are
    variants of them in experiments/run.py), and each is a valid training config."""
    from specjax import default_target as dt
    from specjax.training.config import load_train_config

    cfgs = sorted((REPO / "configs" / "embedded").glob("*.yaml"))
    assert {p.stem for p in cfgs} == set(dt.DRAFTER_NAMES)
    for p in cfgs:
        cfg = load_train_config(p)
        assert cfg.model.kind in ("dspark", "dflash", "eagle3", "mtp", "standalone"), p.name


def test_a_text_only_standalone_reads_text_rows_of_original_replies(setup, tmp_path):
    """A standalone LM trained on text alone (alpha_tv 0) makes prepare write the original replies
    and trains on the answers plus `text_rows` of them (the regenerated prompts passed over); one
    with the default loss (control) reads the answers only and needs no replies."""
    import dataclasses

    from serving_fixtures import write_jsonl
    from specjax.io import read_jsonl
    from specjax.training import build_plan as B
    from train import build_stages as BS

    cfgs = tmp_path / "configs"
    cfgs.mkdir()
    online = {"mode": "online"}
    (cfgs / "text.yaml").write_text(yaml.safe_dump({"model": {"kind": "standalone", "alpha_tv": 0.0},
                                                    "data": online}))
    (cfgs / "tv.yaml").write_text(yaml.safe_dump({"model": {"kind": "standalone"}, "data": online}))
    work = tmp_path / "w"
    (work / "sharegpt").mkdir(parents=True)
    (work / "sharegpt" / "manifest.json").write_text("{}")
    conv = lambda i: {"id": f"c{i}", "conversations": [{"role": "user", "content": f"q{i}"},
                                                       {"role": "assistant", "content": f"a{i}"}]}
    write_jsonl(work / "regen_prompts.jsonl", [{"id": "c1", "turns": ["q1"]}])

    def build(name):
        s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "o"), work_dir=str(work),
                            config_dir=str(cfgs), drafters=(name,), eval_dir=str(setup["eval"]),
                            scale=dataclasses.replace(B.SCALES["smoke"], text_rows=2))
        steps = []
        return BS.program_build(s, runner=lambda st: steps.append(st) or 0, log=lambda m: None), steps

    tv, steps = build("tv")
    assert not tv.wants_text and tv.done_prepare()
    tv.train(tv.plans[0])
    assert not os.path.exists(tv.s.text_out)
    assert any(a == f'data.train_jsonl={json.dumps([tv.s.regen_out])}' for a in steps[0].args)

    text, steps = build("text")
    assert text.plans[0].text_only and text.wants_text and not text.done_prepare()
    text.prepare()
    assert "--references" in steps[0].args
    write_jsonl(work / "sharegpt" / "references.jsonl", [conv(i) for i in range(5)])
    text.train(text.plans[0])
    assert [r["id"] for r in read_jsonl(text.s.text_out)] == ["c0", "c2"]  # c1 was regenerated
    files = json.dumps([text.s.regen_out, text.s.text_out])
    assert any(a == f"data.train_jsonl={files}" for a in steps[1].args)
