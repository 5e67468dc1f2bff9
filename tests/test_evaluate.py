"""train.evaluate / train.calibrate: the Table-1 protocol on mt-bench with a tiny model, STS
calibration written beside a DSpark drafter and applied on load, and the protocol's pure pieces."""
from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
MT_BENCH = REPO.parent / "shared/data/eval/mt-bench.jsonl"
GAMMA = 4


def _engine_config(policy: str = "fixed"):
    """Two slots, one prefill chunk size, tokens buckets {1, gamma + 1}: three executables."""
    from specjax.decoding.engine import EngineConfig

    return EngineConfig(max_slots=2, max_len=256, policy=policy, max_prefill=32, slots_buckets=(2,),
                        tokens_buckets=(1, GAMMA + 1), prefill_buckets=(32,), prefill_batch_buckets=(2,))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random target (vocab 64) with a chat-template tokenizer, and an untrained DSpark drafter
    (1 layer, gamma 4, Markov head, confidence head) saved with the registry."""
    from flax import nnx

    from serving_fixtures import export_tiny_target, tiny_chat_tokenizer
    from specjax import checkpoints
    from specjax.drafters.dspark import BlockDrafterConfig
    from specjax.drafters.dspark import make_block_drafter
    from specjax.drafters.registry import save_drafter

    root = tmp_path_factory.mktemp("evaluate")
    target = export_tiny_target(root / "target")
    tok = tiny_chat_tokenizer()
    tok.chat_template = ("{% for m in messages %}w4 {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}w5{% endif %}")
    tok.save_pretrained(target)
    model, tcfg = checkpoints.load_target(target)
    cfg = BlockDrafterConfig.from_target(tcfg, target_layer_ids=(0, 1), mask_token_id=3, num_draft_layers=1,
                                         block_size=GAMMA, markov_rank=8, confidence_head=True)
    drafter = make_block_drafter(model, tcfg, cfg, nnx.Rngs(0))
    dspark = pathlib.Path(save_drafter(drafter, root / "dspark", target_config=tcfg))
    prompts = root / "heldout.jsonl"
    rng = random.Random(0)
    prompts.write_text("".join(json.dumps({"turns": [" ".join(f"w{rng.randrange(3, 64)}" for _ in range(6))]}) + "\n"
                               for _ in range(6)))
    return {"root": root, "target": target, "dspark": dspark, "model": model, "tcfg": tcfg, "cfg": cfg,
            "prompts": prompts}


@pytest.fixture(scope="module")
def calibrated(setup):
    """The DSpark drafter directory copied and calibrated by `run_calibration`."""
    from specjax.eval.evaluate import EvalSettings, run_calibration

    d = setup["root"] / "dspark_calibrated"
    shutil.copytree(setup["dspark"], d)
    result, path = run_calibration(str(setup["target"]), str(d), [str(setup["prompts"])],
                                   settings=EvalSettings(max_new_tokens=24, seed=5), engine_config=_engine_config(),
                                   progress=False)
    return d, result, path


# ---------------------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------------------

def test_calibrate_writes_calibration_json_that_loading_applies(setup, calibrated):
    from flax import nnx

    from specjax.drafters.dspark import make_block_drafter
    from specjax.drafters.registry import load_drafter
    from specjax.eval import rounds as rd
    from specjax.scheduling.calibration import load_sts

    d, result, path = calibrated
    assert path == str(d / "calibration.json") and pathlib.Path(path).is_file()
    temps, meta = load_sts(path)
    assert temps.shape == (GAMMA,) and not np.allclose(temps, 1.0)
    np.testing.assert_allclose(temps, result.temperatures)
    assert meta["num_rounds"] == result.num_rounds > 0 and meta["samples"] == 6
    # STS fits position 1 by minimising its ECE over a grid that contains T = 1: it cannot get worse
    assert result.after["ece"][0] <= result.before["ece"][0] + 1e-12
    assert result.after["ece_weighted"] < result.before["ece_weighted"]
    # the registry applies it when the directory is loaded (config.json confidence_temperatures) ...
    loaded = load_drafter(d, target=setup["model"])
    np.testing.assert_allclose(np.asarray(loaded.confidence_temperatures[...]), temps, rtol=1e-6)
    assert json.loads((d / "config.json").read_text())["confidence_temperatures"] == pytest.approx(list(temps))
    # ... the uncalibrated original still loads with ones ...
    plain = load_drafter(setup["dspark"], target=setup["model"])
    np.testing.assert_array_equal(np.asarray(plain.confidence_temperatures[...]), np.ones(GAMMA))
    # ... and apply_calibration puts calibration.json onto any drafter of the same shape
    fresh = make_block_drafter(setup["model"], setup["tcfg"], setup["cfg"], nnx.Rngs(1))
    assert rd.apply_calibration(fresh, setup["dspark"]) is None  # no calibration.json there
    got = rd.apply_calibration(fresh, d)
    np.testing.assert_allclose(got, temps)
    np.testing.assert_allclose(np.asarray(fresh.confidence_temperatures[...]), temps, rtol=1e-6)
    # a directory whose config.json lacks the field (e.g. re-exported elsewhere) still has calibration.json
    bare = setup["root"] / "dspark_bare"
    shutil.copytree(d, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["confidence_temperatures"]
    (bare / "config.json").write_text(json.dumps(cfg))
    again = load_drafter(bare, target=setup["model"])
    np.testing.assert_array_equal(np.asarray(again.confidence_temperatures[...]), np.ones(GAMMA))
    np.testing.assert_allclose(rd.apply_calibration(again, bare), temps)
    np.testing.assert_allclose(np.asarray(again.confidence_temperatures[...]), temps, rtol=1e-6)


def test_calibrate_refuses_a_drafter_without_confidence_head(setup, tmp_path):
    from specjax.eval.evaluate import run_calibration

    ngram_dir = tmp_path / "ng"
    ngram_dir.mkdir()
    (ngram_dir / "config.json").write_text(json.dumps({"architectures": ["SpecjaxNGramDrafter"], "vocab_size": 64,
                                                       "num_speculative_tokens": 3, "max_ngram": 3,
                                                       "min_ngram": 1}))
    with pytest.raises(ValueError, match="no confidence head"):
        run_calibration(str(setup["target"]), str(ngram_dir), [str(setup["prompts"])], progress=False)


def test_confidence_logits_round_trip_through_collection_temperature():
    from specjax.eval import rounds as rd

    z = np.array([[-30.0, -3.0, 0.0, 2.5, 40.0]])
    c = 1.0 / (1.0 + np.exp(-(z / rd.COLLECT_TEMPERATURE).astype(np.float32)))
    np.testing.assert_allclose(rd.confidence_logits(c.astype(np.float32), rd.COLLECT_TEMPERATURE), z, atol=2e-3)


def test_round_log_bonus_and_consistency():
    from specjax.eval.rounds import RoundLog

    log = RoundLog()
    log.observe({"ell": [3, 0], "accepted": [3, 0], "stopped": [True, False], "confidence": [[.9] * 3, [.5] * 3]})
    log.observe({"ell": [2], "accepted": [1], "stopped": [False], "confidence": [[.8] * 3]})
    a = log.arrays()
    assert a["accepted"].tolist() == [3, 1] and a["bonus"].tolist() == [0, 1]  # the ell=0 round is dropped
    assert a["confidence"].shape == (2, 3)
    assert log.arrays(drafted_only=False)["proposed"].tolist() == [3, 0, 2]
    with pytest.raises(ValueError, match="confidence"):
        log.observe({"ell": [1], "accepted": [1]})


def test_round_log_keeps_request_ids_and_per_request_parts():
    from specjax.eval.metrics import per_request_tau_parts
    from specjax.eval.rounds import RoundLog

    log = RoundLog()
    log.observe({"request_ids": ["a", "b"], "ell": [3, 3], "accepted": [3, 1], "stopped": [True, False]})
    log.observe({"request_ids": ["b"], "ell": [3], "accepted": [0], "stopped": [False]})
    a = log.arrays()
    assert a["request"].tolist() == ["a", "b", "b"]
    assert per_request_tau_parts(a["request"].tolist(), a["accepted"], a["bonus"]) == {"a": (1, 3), "b": (2, 3)}
    with pytest.raises(ValueError, match="request ids"):
        log.observe({"request_ids": ["a"], "ell": [1, 1], "accepted": [0, 0]})


def test_paired_bootstrap_over_prompts():
    from specjax.eval.metrics import paired_tau_bootstrap

    rng = np.random.default_rng(0)

    def drafter(n, tau, hard, noise=0.0):  # per request: 20 rounds, tokens around tau * 20 * difficulty
        return {f"p{i}": (20, int(round(20 * (tau * hard[i] + noise * rng.normal())))) for i in range(n)}

    hard = rng.uniform(0.3, 1.7, 400)  # prompt difficulty shared by both drafters
    better, worse = drafter(400, 1.45, hard), drafter(400, 1.4, hard)
    ci = paired_tau_bootstrap({"a": better, "b": worse}, lambda t: t["a"] / t["b"] - 1.0)
    assert ci["value"] == pytest.approx(1.45 / 1.4 - 1.0, abs=0.005) and 0.0 < ci["lo"] <= ci["hi"]
    assert ci["p_le_0"] == 0.0 and ci["requests"] == 400
    # pairing: across prompts tau varies +-70%, far more than the 3.6% gap, yet the pair is separated;
    # resampling the two drafters' prompts independently (negative control) cannot separate them
    independent = [paired_tau_bootstrap({"x": d}, lambda t: t["x"], seed=s) for d, s in ((better, 1), (worse, 2))]
    assert independent[0]["lo"] < independent[1]["hi"]
    # same drafter twice: the interval is the single point 0
    same = paired_tau_bootstrap({"a": better, "b": dict(better)}, lambda t: t["a"] - t["b"])
    assert same["lo"] == same["hi"] == same["value"] == 0.0
    # a noisy gap on few prompts is not shown (the interval contains 0)
    few = paired_tau_bootstrap({"a": drafter(8, 1.45, hard, 0.2), "b": drafter(8, 1.4, hard, 0.2)},
                               lambda t: t["a"] / t["b"] - 1.0)
    assert few["lo"] < 0.0 < few["hi"]
    with pytest.raises(ValueError, match="same requests"):
        paired_tau_bootstrap({"a": better, "b": drafter(5, 1.4, hard)}, lambda t: t["a"])
    with pytest.raises(ValueError, match="level"):
        paired_tau_bootstrap({"a": better}, lambda t: t["a"], level=1.0)


# ---------------------------------------------------------------------------------------------
# the protocol's pure pieces
# ---------------------------------------------------------------------------------------------

def test_caps_shuffle_and_domains():
    from specjax.eval.datasets import DEFAULT_CAPS, cap_rows, domain_of, parse_caps

    rows = list(range(20))
    assert cap_rows(rows, 30) == rows and cap_rows(rows, None) == rows
    want = list(rows)
    random.Random(980406).shuffle(want)
    assert cap_rows(rows, 5) == want[:5] != rows[:5]
    assert DEFAULT_CAPS["mt-bench"] == 80 and DEFAULT_CAPS["aime25"] == 30 and DEFAULT_CAPS["mbpp"] == 256
    assert [domain_of(n) for n in ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench",
                                   "mt-bench", "alpaca", "arena-hard-v2")] == ["math"] * 3 + ["code"] * 3 + ["chat"] * 3
    assert domain_of("heldout", "completion") == "code" and domain_of("mine", "chat") == "other"
    assert parse_caps("5") == (5, {}) and parse_caps("gsm8k=100,7") == (7, {"gsm8k": 100})
    with pytest.raises(ValueError, match="cap"):
        parse_caps("gsm8k=x")


def test_prompt_rows(tmp_path):
    from specjax.eval.datasets import first_user_turn, read_prompt_file

    assert first_user_turn({"turns": ["a", "b"]}, "f:1") == ("chat", "a")
    assert first_user_turn({"conversations": [{"role": "system", "content": "s"},
                                              {"role": "user", "content": "u"}]}, "f:1") == ("chat", "u")
    assert first_user_turn({"prompt": "def f():"}, "f:1") == ("completion", "def f():")
    for bad in ({"turns": []}, {"turns": [3]}, {"prompt": ""}, {"x": 1}, [1]):
        with pytest.raises(ValueError, match="f:1"):
            first_user_turn(bad, "f:1")
    p = tmp_path / "mixed.jsonl"
    p.write_text('{"turns": ["a"]}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match="mixes"):
        read_prompt_file(p)
    p.write_text('{"turns": ["a"]}\n{"turns": ["b"\n')
    with pytest.raises(ValueError, match="mixed.jsonl:2"):
        read_prompt_file(p)


# ---------------------------------------------------------------------------------------------
# the evaluation on mt-bench
# ---------------------------------------------------------------------------------------------

def _rates_ok(values) -> bool:
    vals = [v for v in values if v is not None]
    return bool(vals) and all(0.0 <= v <= 1.0 for v in vals)


@pytest.mark.skipif(not MT_BENCH.is_file(), reason=f"{MT_BENCH} is absent (the shared eval prompt sets)")
def test_evaluate_mt_bench_first_5_prompts(setup, calibrated, tmp_path):
    from specjax.eval.evaluate import EvalSettings, run_evaluation

    out = tmp_path / "eval"
    dspark_dir = str(calibrated[0])
    res = run_evaluation(str(setup["target"]), ["ngram", dspark_dir], [str(MT_BENCH)], str(out), cap=5,
                         settings=EvalSettings(max_new_tokens=16), engine_config=_engine_config(), progress=False)
    for name in ("results.json", "results.md", "acceptance_by_position.png", "reliability_dspark_calibrated.png"):
        f = out / name
        assert f.is_file() and f.stat().st_size > 0, name
        if name.endswith(".png"):
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "results.json").read_text())
    assert doc["datasets"]["mt-bench"] == {"path": os.path.relpath(MT_BENCH), "kind": "chat", "domain": "chat", "rows": 80,
                                           "evaluated": 5}
    assert set(doc["drafters"]) == {"ngram", "dspark_calibrated"}
    for name, r in doc["drafters"].items():
        e = r["datasets"]["mt-bench"]
        assert e["num_samples"] == 5 and e["num_rounds"] > 0 and e["generated_tokens"] >= 5
        assert 1.0 <= e["tau"] <= GAMMA + 1
        # tau = (accepted + bonus) per round: within [accepted, accepted + 1] per round
        assert e["num_accepted_tokens"] / e["num_rounds"] <= e["tau"] <= 1 + e["num_accepted_tokens"] / e["num_rounds"]
        assert len(e["accept_rate"]) == GAMMA and _rates_ok(e["accept_rate"]) and _rates_ok(e["cond_accept"])
        assert all(a >= b for a, b in zip(e["accept_rate"], e["accept_rate"][1:]))  # prefix survival decreases
        assert r["domains"] == {"chat": pytest.approx(e["tau"])} and r["macro"] == pytest.approx(e["tau"])
    assert doc["drafters"]["ngram"]["has_confidence_head"] is False
    assert doc["drafters"]["ngram"]["datasets"]["mt-bench"]["confidence"] is None
    ds = doc["drafters"]["dspark_calibrated"]
    assert ds["has_confidence_head"] is True
    assert ds["calibration"] == pytest.approx(list(calibrated[1].temperatures), rel=1e-6)
    conf = ds["datasets"]["mt-bench"]["confidence"]
    for when in ("before", "after"):
        c = conf[when]
        assert _rates_ok(c["ece"]) and _rates_ok(c["brier"])
        assert all(v is None or 0.0 <= v <= 1.0 for v in c["auroc"])
        assert c["count"][0] == ds["datasets"]["mt-bench"]["num_rounds"]
    assert conf["before"]["ece"] != conf["after"]["ece"]
    # per-request parts (the engine's request ids) add up to the dataset's tau; the overall
    # interval from the bootstrap over prompts contains it
    for r in doc["drafters"].values():
        e, ov = r["datasets"]["mt-bench"], r["overall"]
        assert sorted(e["requests"]) == [f"mt-bench:{i}" for i in range(5)]
        rounds, tokens = (sum(v[j] for v in e["requests"].values()) for j in (0, 1))
        assert rounds == e["num_rounds"] and tokens / rounds == pytest.approx(e["tau"])
        lo, hi = ov["tau_ci95"]
        assert lo <= ov["tau"] <= hi
    assert res["table"][1]["drafter"] == "dspark_calibrated" and res["table"][1]["macro"] == pytest.approx(ds["macro"])
    md = (out / "results.md").read_text()
    assert "| Drafter | mt-bench | chat | macro |" in md
    row = next(line for line in md.splitlines() if line.startswith("| dspark_calibrated |"))
    assert f"{ds['datasets']['mt-bench']['tau']:.2f}" in row
    assert "ECE after" in md and "ECE before" in md


def _metrics(doc, name):
    e = doc["drafters"][name]["datasets"]["mt-bench"]
    keep = ("num_rounds", "num_accepted_tokens", "tau", "accept_rate", "cond_accept", "requests", "generated_tokens")
    return {k: e[k] for k in keep}, e


def test_a_killed_evaluation_resumes_with_the_same_results_and_refuses_other_settings(setup, tmp_path, monkeypatch):
    """Each finished request is one line of out/progress/<drafter>__<dataset>.jsonl; after a kill
    (the file cut to two requests and a torn line) the rerun decodes only the other requests and
    reports what the uninterrupted run reported. Control: a rerun that forgets the stored rounds
    reports other numbers. Other settings into the same out directory are refused, naming the file."""
    from specjax.eval import resume
    from specjax.eval.evaluate import EvalSettings, run_evaluation

    def run(out, **kw):
        run_evaluation(str(setup["target"]), [str(setup["dspark"])], [str(MT_BENCH)], str(out), cap=5,
                       settings=EvalSettings(max_new_tokens=kw.get("max_new_tokens", 12), seed=3),
                       engine_config=_engine_config(), progress=False)
        return json.loads((out / "results.json").read_text())

    full, full_entry = _metrics(run(tmp_path / "a"), "dspark")
    assert full_entry["resumed_requests"] == 0
    prog = tmp_path / "a" / "progress" / "dspark__mt-bench.jsonl"
    lines = prog.read_text().splitlines(keepends=True)
    assert len(lines) == 1 + 5 and "fingerprint" in lines[0]
    for out, control in ((tmp_path / "b", False), (tmp_path / "c", True)):
        (out / "progress").mkdir(parents=True)
        (out / "progress" / prog.name).write_text("".join(lines[:3]) + lines[3][:20])  # killed mid-line
        if control:
            monkeypatch.setattr(resume.EvalProgress, "stored_log", lambda self, ids: resume.RoundLog())
        again, entry = _metrics(run(out), "dspark")
        assert entry["resumed_requests"] == 2
        assert (again != full) if control else (again == full)
        written = [json.loads(x)["request"] for x in (out / "progress" / prog.name).read_text().splitlines()[1:]]
        assert sorted(written) == [f"mt-bench:{i}" for i in range(5)]  # each request once
    monkeypatch.undo()
    with pytest.raises(ValueError, match="dspark__mt-bench.jsonl holds the progress of an evaluation run with other "
                                         "settings \\(differing: protocol\\)"):
        run(tmp_path / "a", max_new_tokens=13)


def test_evaluate_cli_rejects_bad_arguments(setup, tmp_path, capsys):
    from train.evaluate import main

    rc = main(["--target", str(setup["target"]), "--drafter", "ngram", "--data", str(setup["prompts"]),
               "--out", str(tmp_path / "o"), "--cap", "gsm8k=many"])
    assert rc == 2 and "cap" in capsys.readouterr().err
    rc = main(["--target", str(setup["target"]), "--drafter", str(tmp_path / "missing"), "--data",
               str(setup["prompts"]), "--out", str(tmp_path / "o")])
    assert rc == 2 and "neither 'ngram' nor a drafter directory" in capsys.readouterr().err


def test_calibrate_cli_rejects_bad_arguments(setup, tmp_path, capsys):
    from train.calibrate import main

    rc = main(["--target", str(setup["target"]), "--drafter", str(setup["dspark"]), "--prompts",
               str(setup["prompts"]), "--cap", "0"])
    assert rc == 2 and "--cap" in capsys.readouterr().err
    rc = main(["--target", str(setup["target"]), "--drafter", str(tmp_path / "missing"), "--prompts",
               str(setup["prompts"])])
    assert rc == 2 and "drafter directory does not exist" in capsys.readouterr().err
    assert not (setup["dspark"] / "calibration.json").exists()


def test_recorded_paths_are_relative_even_outside_the_checkout(tmp_path, monkeypatch):
    """Results name evaluation files relative to the working directory, never by an absolute path."""
    from specjax.eval.evaluate import _display_path

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    outside = tmp_path / "shared" / "eval" / "gsm8k.jsonl"
    assert _display_path(outside) == "../shared/eval/gsm8k.jsonl"
    assert _display_path(tmp_path / "work" / "x.jsonl") == "x.jsonl"


@pytest.mark.parametrize("settings, variant", [(dict(temperature=0.0), "greedy"), (dict(temperature=1.0), "plain"),
                                               (dict(temperature=1.0, top_p=0.9), "filtered"),
                                               (dict(temperature=0.0, top_k=5), "filtered")])
def test_default_engine_compiles_the_one_sampling_variant_of_the_settings(settings, variant):
    """Every request of an evaluation samples one way: its default engine compiles that round
    variant only (a given engine config is kept as it is)."""
    from types import SimpleNamespace

    from specjax.decoding.engine import EngineConfig
    from specjax.eval import evaluate as ev
    from specjax.eval.datasets import Dataset

    ds = [Dataset(name="d", path="d.jsonl", kind="chat", domain="chat", prompts=[[1, 2, 3]], total_rows=1)]
    tcfg = SimpleNamespace(max_position_embeddings=64)
    cfg = ev._fixed_engine_config(None, ds, tcfg, ev.EvalSettings(max_new_tokens=4, **settings), 2, None, 16, "t")
    assert cfg.sampling_variants == (variant,) and cfg.policy == "fixed" and cfg.max_len == 8
    given = EngineConfig(policy="fixed", max_len=32)
    assert ev._fixed_engine_config(given, ds, tcfg, ev.EvalSettings(**settings), 2, None, 16, "t") is given
