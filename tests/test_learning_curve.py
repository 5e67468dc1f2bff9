"""Learning curves (`specjax.eval.curve`, `TrainConfig.curve`): a training run records the drafter's
tau at T=0 on greedy texts every N steps and at its end, per prompt set; a resumed run adds only new
steps; the points are the trained drafter's (equal to the exported drafter's replay, unlike the
initial drafter's); bad curve settings and malformed text files are refused naming the field."""
from __future__ import annotations

import json
import pathlib
import random
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_build_embedded import WORDS, _tiny_llama_target  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny chat Llama, 48 chat rows answered by its own greedy decoding (what the build trains
    on: learnable in a few steps), and two prompt sets."""
    from specjax.api import LLM, SamplingParams

    root = tmp_path_factory.mktemp("curve")
    target = _tiny_llama_target(root)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) for _ in range(48)]
    llm = LLM(str(target), max_model_len=64, max_prefill=16, dtype="float32")
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12))
    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": p},
                                              {"role": "assistant", "content": o.text}]}
            for i, (p, o) in enumerate(zip(prompts, outs))]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = root / "heldout.jsonl"
    held.write_text("".join(json.dumps({"turns": [" ".join(rng.choice(WORDS) for _ in range(4))]}) + "\n"
                            for _ in range(6)))
    return {"root": root, "target": target, "train": train, "heldout": held}


def _config(s, run: str, **curve) -> pathlib.Path:
    d = s["root"] / run
    cfg = {"name": run, "seed": 1,
           "model": {"kind": "dspark", "target": str(s["target"]), "mask_token_id": 3, "target_layer_ids": [0, 1],
                     "num_draft_layers": 1, "block_size": 4, "markov_rank": 8, "confidence_head": True,
                     "num_anchors": 8, "compute_dtype": "float32", "target_dtype": "float32"},
           "optimizer": {"learning_rate": 0.002, "warmup_ratio": 0.0},
           "schedule": {"total_steps": 1000},
           "data": {"mode": "online", "train_jsonl": [str(s["train"])], "max_length": 64, "min_loss_tokens": 2,
                    "batch_size": 8, "length_buckets": [64]},
           "checkpoint": {"directory": str(d / "ckpt"), "save_every": 4, "keep": 1, "async_save": False},
           "logging": {"directory": str(d / "logs"), "every": 1, "tensorboard": False, "progress": False},
           "export_dir": str(d / "export"),
           "curve": {"every": 4, "prompts": 6, "max_tokens": 12, "max_prompt_tokens": 16,
                     "sets": [{"name": "train", "files": [str(s["train"])]},
                              {"name": "heldout", "files": [str(s["heldout"])]}], **curve}}
    path = s["root"] / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _points(s, run: str) -> list[dict]:
    from specjax.io import read_jsonl
    return read_jsonl(s["root"] / run / "logs" / "learning_curve.jsonl")


def test_a_run_records_its_curve_resumes_it_once_and_measures_the_trained_drafter(setup, capsys):
    from specjax.checkpoints import load_target
    from specjax.drafters import registry
    from specjax.eval.curve import LearningCurve, read_curve_texts
    from train import train_draft

    s = setup
    cfg = _config(s, "run")
    assert train_draft.main(["--config", str(cfg), "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "curve: greedy texts {'train': 6, 'heldout': 6}" in out, out[-2000:]
    points = _points(s, "run")
    assert [p["step"] for p in points] == [4, 8, 10]  # every 4 steps and the run's end
    for p in points:
        assert set(p["sets"]) == {"train", "heldout"} and p["eval_s"] >= 0
        assert all(v["rounds"] > 0 and v["tau"] >= 1.0 for v in p["sets"].values())
    # the curve follows training: the (constant) greedy answers of the random target are learnt
    assert points[0]["sets"]["train"]["tau"] < points[-1]["sets"]["train"]["tau"]

    # a resumed run adds only its new steps (the texts are read, not made again)
    assert train_draft.main(["--config", str(cfg), "--steps", "12"]) == 0
    assert "curve: greedy texts" not in capsys.readouterr().out
    again = _points(s, "run")
    assert again[:3] == points and [p["step"] for p in again] == [4, 8, 10, 12]

    # the last point is the exported drafter's replay on the same texts; the initial drafter's is not
    target, _ = load_target(s["target"], dtype="float32")
    texts = read_curve_texts(s["root"] / "run" / "logs" / "curve_texts.jsonl")
    drafter = registry.load_drafter(s["root"] / "run" / "export", target=target)
    curve = LearningCurve(target, texts, max_len=16 + 12 + 16, max_tokens=12, tap_layers=drafter.tap_layers)
    assert curve.taus(drafter) == again[-1]["sets"]
    from specjax.training.config import load_train_config
    from specjax.training.run import build
    run = build(load_train_config(cfg))
    initial = run.trainer.model(run.trainer.init_state())
    assert curve.taus(initial)["train"]["tau"] < again[-1]["sets"]["train"]["tau"]  # negative control
    run.trainer.close()


def test_the_drafter_is_exported_before_the_last_curve_point(setup, monkeypatch):
    """A run killed while measuring its last curve point (as the build kills a child at its share)
    has already exported the drafter it trained."""
    from specjax.eval import curve as C
    from specjax.training.build_outputs import PROGRESS_NAME
    from train import train_draft

    real = C.curve_hook

    def killed_at_the_end(*a, **k):
        hook = real(*a, **k)

        def measure(step, state, metrics=None, *, force=False):
            if force:
                raise RuntimeError("killed while measuring")
            return hook(step, state, metrics, force=force)
        return measure

    monkeypatch.setattr(C, "curve_hook", killed_at_the_end)
    texts = setup["root"] / "cut_texts.jsonl"  # given, so that no engine makes them
    row = {"prompt_ids": [5, 6, 7], "answer_ids": [8, 9, 10, 11]}
    texts.write_text("".join(json.dumps({"set": name, **row}) + "\n" for name in ("train", "heldout")))
    cfg = _config(setup, "cut", prompts=2, max_tokens=4, texts=str(texts))
    with pytest.raises(RuntimeError, match="killed while measuring"):
        train_draft.main(["--config", str(cfg), "--steps", "2"])
    progress = json.loads((setup["root"] / "cut" / "export" / PROGRESS_NAME).read_text())
    assert progress["step"] == 2 and (setup["root"] / "cut" / "export" / "config.json").is_file()


@pytest.mark.parametrize("curve, field", [
    ({"every": -1}, "'every'"), ({"sets": []}, "'sets'"), ({"prompts": 0}, "'prompts'"),
    ({"sets": [{"name": "a", "files": ["x"]}, {"name": "a", "files": ["y"]}]}, "repeat"),
    ({"sets": [{"name": "a", "files": []}]}, "'files'"),
])
def test_bad_curve_settings_are_refused_naming_the_field(setup, curve, field):
    from specjax.config import ConfigError
    from specjax.training.config import load_train_config

    with pytest.raises(ConfigError, match=field):
        load_train_config(_config(setup, "bad", **curve))


def test_a_missing_prompt_file_and_malformed_texts_are_named(setup, tmp_path, capsys):
    from specjax.eval.curve import read_curve_texts
    from train import train_draft

    cfg = _config(setup, "missing", sets=[{"name": "gone", "files": [str(tmp_path / "nope.jsonl")]}])
    assert train_draft.main(["--config", str(cfg), "--steps", "1"]) == 2
    assert "curve set 'gone': prompt file" in capsys.readouterr().err
    bad = tmp_path / "texts.jsonl"
    bad.write_text(json.dumps({"set": "a", "prompt_ids": [1, 2], "answer_ids": []}) + "\n")
    with pytest.raises(ValueError, match=r"texts.jsonl:1: field 'answer_ids'"):
        read_curve_texts(bad)
