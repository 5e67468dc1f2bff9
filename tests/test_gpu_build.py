"""The GPU build profile (`train.build_embedded --scale gpu --budget-s N`) end to end on a tiny
random Llama on the CPU (`--allow-cpu`), in process: a printed plan, regeneration seeded from an
answers artifact and answering every user turn, online training at batch 64, each stage stopped
at its share keeping its work (regeneration cut, training cut with a checkpoint and an export),
a second run with more budget continuing both, the pack that leaves the machine and its unpack,
and the bad inputs (a budget too small, no accelerator, a pack over the limits, a truncated
artifact). About a minute and a half on an idle 2-core machine (two budgeted runs)."""
from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_build_embedded import EVAL_PROMPT, WORDS, build_inputs  # noqa: E402


def _sharegpt(root: pathlib.Path, n: int = 160) -> pathlib.Path:
    """n two-turn conversations of 3-6 words a turn (one first turn is an evaluation prompt)."""
    import random

    rng = random.Random(1)
    words = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
    recs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": words()}, {"from": "gpt", "value": "w30 w31"},
        {"from": "human", "value": words()}, {"from": "gpt", "value": "w32 w33"}]}
        for i in range(n)]
    recs[3]["conversations"][0]["value"] = EVAL_PROMPT
    path = root / "sharegpt.json"
    path.write_text(json.dumps(recs))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpubuild")
    return build_inputs(root, _sharegpt(root))


def _argv(s, *extra: str, work: str = "work", out: str = "out") -> list[str]:
    r = s["root"]
    return ["--in-process", "--scale", "gpu", "--allow-cpu", "--target", str(s["target"]),
            "--out-dir", str(r / out), "--work-dir", str(r / work),
            "--config-dir", str(s["configs"]), "--eval-dir", str(s["eval"]),
            "--sharegpt", str(s["sharegpt"]), "--drafters", "dspark", "mtp1", "--rows", "80",
            "--max-new-tokens", "8", "--prompt-max-tokens", "16", "--context-tokens", "64",
            "--steps", "200",
            "--calibrate-prompts", "2", "--calibrate-tokens", "4", "--heldout-fraction", "0.2",
            "--curve-prompts", "2", "--curve-tokens", "8",
            "--regen-slots", "1", "--min-unit-s", "0.5", *extra]


class _SteppingClock:
    """`time` for the regeneration's deadline: monotonic() advances 0.1 s a reading; the rest is
    the real module's."""

    def __init__(self) -> None:
        self._now = 0.0

    def monotonic(self) -> float:
        self._now += 0.1
        return self._now

    def __getattr__(self, name: str):
        return getattr(time, name)


def _seed_artifact(path: pathlib.Path, prompts: list[dict]) -> list[dict]:
    from specjax.training.answers import write_answers

    rows = [{"id": p["id"], "conversations": [{"role": "user", "content": p["turns"][0]},
                                              {"role": "assistant", "content": "w40 w41 w42"}]}
            for p in prompts]
    write_answers(str(path), rows[::-1])  # any order
    return rows


def test_gpu_profile_budgeted_cut_resumed_packed_and_unpacked(setup, capsys, monkeypatch):
    """The build's clock is frozen, so every unit gets its planned share of the budget whatever
    this machine's load (the trainings' own deadlines run on the real clock, regeneration's in run
    1 on a stepping one): run 1's shares are below the time to load and compile, or to answer the
    prompts, so regeneration and both trainings stop at them."""
    from specjax import checkpoints, jobs
    from specjax.training import build_budget
    from specjax.drafters import registry
    from specjax.io import read_jsonl
    from specjax.training.build_pack import LIMITS
    from train import build_embedded
    from train import regenerate as regenerate_program

    s, r = setup, setup["root"]
    work, out = r / "work", r / "out"
    assert build_embedded.main(_argv(s, "--stages", "prepare")) == 0
    prompts = read_jsonl(work / "sharegpt" / "prompts.jsonl")
    assert sum(len(p["turns"]) == 2 for p in prompts) >= 10  # later user turns are kept
    assert len(prompts) >= 80
    seed = _seed_artifact(r / "seed.jsonl.gz", prompts[:70])  # >= one batch of 64
    stages = ["--stages", "regenerate", "vocab", "train", "calibrate", "export"]

    # run 1: 20 s of budget (15 s after the packing reserve); regeneration and training stop.
    # Regeneration reads a clock that advances 0.1 s a reading (its share, ~4 s, ends after a
    # fixed number of engine steps, too few for its 10 prompts on any machine)
    monkeypatch.setattr(build_budget, "CLOCK", lambda: 0.0)
    monkeypatch.setattr(regenerate_program, "time", _SteppingClock())
    monkeypatch.setattr(jobs, "time", regenerate_program.time)
    capsys.readouterr()
    rc = build_embedded.main(_argv(s, *stages, "--budget-s", "20", "--seed-answers",
                                   str(r / "seed.jsonl.gz"), "--pack", str(r / "pack")))
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert printed.index("budget plan:") < printed.index("] regenerate")
    assert "train/dspark" in printed.split("budget plan:")[1].split("running")[0]
    rec = json.loads((out / "BUILD.json").read_text())
    st = rec["stages"]
    assert st["regenerate"]["complete"] is False  # cut
    assert "answer_tokens_per_s" in st["regenerate"]["last_run"]
    assert read_jsonl(work / "regen_seed.jsonl") == seed  # prompt order, seeded once
    regen = read_jsonl(work / "regen.jsonl")
    assert not {x["id"] for x in regen} & {x["id"] for x in seed}  # seeded prompts not redone
    steps1 = {}
    for name in ("dspark", "mtp1"):
        assert f"train/{name}" in st, printed[-6000:]
        last = st[f"train/{name}"]["last_run"]
        assert st[f"train/{name}"]["complete"] is False and 1 <= last["step"] < 200
        assert last["batch_size"] == 64 and last["status"] == "time_limit"
        steps1[name] = last["step"]
        # the drafter trained so far is exported, shipped (lean) and recorded with its maker
        assert (work / "exports" / name / "config.json").is_file()
        assert (out / "drafters" / name / "config.json").is_file()
        assert rec["drafter_builds"][name]["command"].startswith("python -m train.build_embedded")
        assert rec["drafter_builds"][name]["machine"]["jax_backend"] == "cpu"
    assert rec["data"]["answers"]["samples"] == len(seed) + len(regen)
    assert rec["settings"]["budget_s"] is not None
    # DSpark's learning curve: a point at the step training stopped, on the three sets
    curve = read_jsonl(work / "train" / "dspark" / "logs" / "learning_curve.jsonl")
    assert [p["step"] for p in curve] == [steps1["dspark"]]
    assert set(curve[0]["sets"]) == {"train", "heldout", "table1"}
    assert not (work / "train" / "mtp1" / "logs" / "learning_curve.jsonl").exists()

    # the pack: few small files, the answers (seed + new), lean drafters, the record
    files = sorted(os.listdir(r / "pack"))
    sizes = [os.path.getsize(r / "pack" / f) for f in files]
    assert len(files) <= LIMITS.files and max(sizes) <= LIMITS.file_bytes
    assert {"PACK.json", "BUILD.json", "answers.jsonl.gz", "build.tar.00"} <= set(files)
    with gzip.open(r / "pack" / "answers.jsonl.gz", "rt") as f:
        packed = [json.loads(x) for x in f]
    assert len(packed) == len(seed) + len(regen)

    # run 2, with more budget: regeneration resumes (appends) and finishes; then training
    # continues from run 1's checkpoints
    monkeypatch.setattr(regenerate_program, "time", time)  # the real clock again
    monkeypatch.setattr(jobs, "time", time)
    capsys.readouterr()
    seeded = ["--seed-answers", str(r / "seed.jsonl.gz")]
    rc = build_embedded.main(_argv(s, "--stages", "regenerate", "--budget-s", "300", *seeded))
    assert rc == 0, capsys.readouterr().out[-3000:]
    rc = build_embedded.main(_argv(s, "--stages", "vocab", "train", "export", "--budget-s", "12",
                                   *seeded))
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    rec = json.loads((out / "BUILD.json").read_text())
    regen2 = read_jsonl(work / "regen.jsonl")
    assert regen2[: len(regen)] == regen and rec["stages"]["regenerate"]["runs"] == 2
    assert rec["stages"]["regenerate"]["complete"] and len(regen2) == 80 - len(seed)
    multi = [x for x in regen2 if len(x["conversations"]) == 4]
    assert multi, "every user turn is answered"
    for name in ("dspark", "mtp1"):
        last = rec["stages"][f"train/{name}"]["last_run"]
        assert last["step"] > steps1[name] and last["steps_this_run"] == last["step"] - steps1[name]
        assert rec["drafter_builds"][name]["steps"] == last["step"]

    # unpack the run-1 pack into a fresh output directory (the shipped layout)
    assert build_embedded.main(_argv(s, "--unpack", str(r / "pack"), out="shipped",
                                     work="work_home")) == 0
    shipped = r / "shipped"
    target, _ = checkpoints.load_target(s["target"])
    for name in ("dspark", "mtp1"):
        registry.load_drafter(shipped / "drafters" / name, target=target)
        with checkpoints.SafetensorsDir(shipped / "drafters" / name) as rd:
            assert "embed_tokens.weight" not in rd  # trimmed: no frozen target tensors
    got = json.loads((shipped / "BUILD.json").read_text())
    assert set(got["drafter_builds"]) == {"dspark", "mtp1"} and got["unpacked_build"]["stages"]
    with gzip.open(shipped / "regen" / "answers.jsonl.gz", "rt") as f:
        assert [json.loads(x) for x in f] == packed
    assert (r / "work_home" / "logs" / "dspark" / "metrics.jsonl").is_file()
    assert read_jsonl(r / "work_home" / "logs" / "dspark" / "learning_curve.jsonl") == curve
    assert (shipped / "split.json").is_file()
    _truncated_artifact_and_pack_limits(s, capsys)


def test_bad_inputs_budget_and_accelerator(setup, capsys):
    """(The truncated artifact and the pack's file limits are checked on the profile test's work
    directory, at its end: `_truncated_artifact_and_pack_limits`.)"""
    from train import build_embedded

    s, r = setup, setup["root"]
    # no accelerator: refused unless --allow-cpu (this machine has only its CPU)
    import jax

    if jax.default_backend() == "cpu":
        argv = [a for a in _argv(s, "--stages", "regenerate") if a != "--allow-cpu"]
        assert build_embedded.main(argv) == 1
        assert "--allow-cpu" in capsys.readouterr().err
    # a budget too small for any stage names the flag; nothing is recorded
    assert build_embedded.main(_argv(s, "--stages", "vocab", "train", "--budget-s", "0.1",
                                     work="work_small", out="out_small")) == 1
    assert "--budget-s 0.1 is too small" in capsys.readouterr().err
    assert not (r / "out_small" / "BUILD.json").exists()


def _truncated_artifact_and_pack_limits(s: dict, capsys) -> None:
    from specjax.training import build_plan as B
    from specjax.training.build_outputs import BuildError
    from specjax.training.build_pack import PackLimits, pack
    from train import build_embedded
    r = s["root"]
    work = r / "work"
    # a truncated artifact: an error naming the file, and the work done stays as it was
    good = (r / "seed.jsonl.gz").read_bytes()
    (r / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    spare = r / "work_cut"
    shutil.copytree(work, spare)
    os.remove(spare / "regen_seed.jsonl")
    before = (spare / "regen.jsonl").read_bytes()
    rc = build_embedded.main(_argv(s, "--stages", "regenerate", "--seed-answers",
                                   str(r / "cut.jsonl.gz"), work="work_cut"))
    assert rc == 1 and "cut.jsonl.gz: corrupt or truncated" in capsys.readouterr().err
    assert (spare / "regen.jsonl").read_bytes() == before

    # a pack over the file limits is refused naming the limit; nothing written
    settings = B.BuildSettings(target=str(s["target"]), out_dir=str(r / "out"),
                               work_dir=str(work), config_dir=str(s["configs"]),
                               drafters=("dspark", "mtp1"), eval_dir=str(s["eval"]),
                               scale=B.SCALES["gpu"], seed_answers=str(r / "seed.jsonl.gz"))
    with pytest.raises(BuildError, match=r"over the limit of 3 files"):
        pack(settings, str(r / "pack_small"), limits=PackLimits(files=3, file_bytes=2**30))
    with pytest.raises(BuildError, match=r"over the limit of 105 bytes \(.* MiB\) per file"):
        pack(settings, str(r / "pack_small"), limits=PackLimits(file_bytes=105, files=10**6))
    with pytest.raises(BuildError, match=r"over the limit of 1049 bytes \(.* MiB\) in all"):
        pack(settings, str(r / "pack_small"), limits=PackLimits(total_bytes=1049))
    assert not (r / "pack_small").exists()


def test_a_child_past_its_share_is_stopped_and_the_stage_cut(tmp_path, monkeypatch):
    """A program stage run as a child process (calibration has no budget flag) is killed at its
    share plus the grace and the build records the stage as cut, not failed."""
    from train import build_stages as BS

    (tmp_path / "sleepy.py").write_text("import time\ndef main(a=None):\n    time.sleep(60)\n"
                                        "if __name__ == '__main__':\n    main()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert BS.run_child(BS.Step("sleepy", [], timeout_s=1.0)) == (BS.TIMED_OUT, "")
    assert BS.run_child(BS.Step("json.tool", ["--help"])) == (0, "")


def test_a_failed_childs_last_error_lines_name_the_cause(tmp_path, monkeypatch, capfd):
    """A child that fails (here as train_draft does when a drafter's step runs out of memory) is
    a BuildError whose message, recorded as the unit's last_error, ends with the child's last
    stderr lines; its whole stderr still reaches the console, progress bars included."""
    from specjax.training.build_outputs import BuildError
    from train import build_stages as BS

    (tmp_path / "oom.py").write_text(
        "import sys\nsys.stderr.write('train:  0%|  | 0/9\\rtrain: 11%|# | 1/9')\n"
        "sys.stderr.write('\\nTraceback (most recent call last):\\n  File x\\n"
        "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 28439225304 bytes.\\n')\n"
        "sys.exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    res = BS.run_child(BS.Step("oom", []))
    assert res.status == 1 and res.error_tail.endswith("RESOURCE_EXHAUSTED: Out of memory allocating "
                                                       "28439225304 bytes.")
    assert "11%|# | 1/9\n" in capfd.readouterr().err
    stages = BS.ProgramStages(lambda step: res)

    class B:  # the parts of a Build that launching reads
        budget, log = None, staticmethod(lambda m: None)

    with pytest.raises(BuildError, match=r"exit status 1: .*File x \| jax.errors.JaxRuntimeError: "
                                         r"RESOURCE_EXHAUSTED"):
        stages._run(B, BS.Step("oom", []))


def test_budget_plan_shares_and_floor():
    from specjax.training.build_budget import Budget, BudgetError

    b = Budget(100.0, min_unit_s=1.0)
    units = [("regenerate", "regenerate"), ("train/a", "train"), ("train/b", "train"),
             ("export", "export")]
    shares = b.plan(units, 100.0)
    assert abs(sum(shares) - 100.0) < 1e-9 and shares[1] == shares[2]  # a stage splits evenly
    assert shares[0] > shares[3]
    with pytest.raises(BudgetError, match=r"--budget-s 2.5 is too small"):
        Budget(2.5, min_unit_s=1.0).check(units)  # export always runs: 3 units need 3 s


def test_without_prepared_prompts_the_artifact_alone_feeds_training(setup, tmp_path):
    """A machine without the ShareGPT data (no prepare stage): every answer of the artifact is
    training data, and calibration reads the shipped held-out prompts."""
    from specjax.io import read_jsonl
    from specjax.training import build_plan as B
    from train import build_stages as BS

    out = tmp_path / "out"
    (out / "prompts").mkdir(parents=True)
    (out / "prompts" / "heldout.jsonl").write_text(json.dumps({"id": "h", "turns": ["w11"]}) + "\n")
    seed = _seed_artifact(tmp_path / "a.jsonl.gz", [{"id": f"p{i}", "turns": [f"w{10 + i}"]}
                                                    for i in range(3)])
    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(out), work_dir=str(tmp_path / "w"),
                        config_dir=str(setup["configs"]), drafters=("dspark", "mtp1"),
                        eval_dir=str(setup["eval"]), scale=B.SCALES["gpu"],
                        seed_answers=str(tmp_path / "a.jsonl.gz"))
    steps = []
    b = BS.program_build(s, runner=lambda st: steps.append(st) or 0, log=lambda m: None)
    b.train(b.plans[1])
    assert sorted(map(json.dumps, read_jsonl(s.regen_seed))) == sorted(map(json.dumps, seed))
    assert f"data.train_jsonl={json.dumps([s.regen_seed])}" in steps[0].args
    assert "data.batch_size=64" in steps[0].args and "model.compute_dtype=bfloat16" in steps[0].args
    os.makedirs(s.export_dir("dspark"))
    open(os.path.join(s.export_dir("dspark"), "config.json"), "w").close()
    b.calibrate(b.plans[0])
    assert steps[1].args[steps[1].args.index("--prompts") + 1] == str(out / "prompts" / "heldout.jsonl")


def test_a_seeded_build_caches_the_artifact_without_a_regenerate_stage(setup, tmp_path):
    """`--stages cache train` with `--seed-answers` on a machine without prepared prompts: the cache
    stage seeds the work directory first and caches the artifact's answers."""
    from specjax.io import read_jsonl
    from specjax.training import build_plan as B
    from train import build_stages as BS

    import dataclasses

    from specjax.training.answers import read_answers

    seed = _seed_artifact(tmp_path / "a.jsonl.gz", [{"id": f"p{i}", "turns": [f"w{10 + i}"]} for i in range(3)])
    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "w"),
                        config_dir=str(setup["configs"]), drafters=("dspark",), eval_dir=str(setup["eval"]),
                        scale=B.SCALES["full"], seed_answers=str(tmp_path / "a.jsonl.gz"))
    steps = []
    b = BS.program_build(s, runner=lambda st: steps.append(st) or 0, log=lambda m: None)
    b.cache()
    assert steps[0].module == "train.build_cache"
    assert steps[0].args[steps[0].args.index("--data") + 1] == s.regen_seed
    assert sorted(map(json.dumps, read_jsonl(s.regen_seed))) == sorted(map(json.dumps, seed))
    # a build of fewer rows seeds that many answers of the artifact (in its order)
    small = dataclasses.replace(s, work_dir=str(tmp_path / "w2"), scale=dataclasses.replace(s.scale, rows=2))
    BS.program_build(small, runner=lambda st: 0, log=lambda m: None).cache()
    assert read_jsonl(small.regen_seed) == read_answers(str(tmp_path / "a.jsonl.gz"))[:2]


def test_the_gpu_drafters_fit_the_shipped_budget_checked_before_training(tmp_path, monkeypatch):
    """configs/gpu (DSpark, DSpark-RNN, DFlash, Eagle3, MTP-1 at the target's MLP width) and the
    CPU-built standalone LM fit 64 MiB for SmolLM2's shape, from the configs alone; a build whose
    drafters would not fit its --budget-mb is refused before any stage runs (control: 30 MiB)."""
    from bench.common import RANDOM_TARGET_SHAPE
    from specjax.config import TargetConfig
    from specjax.training import build_plan as B
    from specjax.training.build_outputs import BuildError, planned_bytes
    from train import build_stages as BS

    target = tmp_path / "smollm2-shape"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TargetConfig(**RANDOM_TARGET_SHAPE).to_hf_dict()))
    names = ("dspark", "dspark-rnn", "dflash", "eagle3", "mtp1")
    gpu = {n: planned_bytes(str(REPO / "configs" / "gpu" / f"{n}.yaml"), str(target)) for n in names}
    standalone = planned_bytes(str(REPO / "configs" / "embedded" / "standalone.yaml"), str(target))
    cpu_dspark = planned_bytes(str(REPO / "configs" / "embedded" / "dspark.yaml"), str(target))
    assert gpu["dspark"] > 1.3 * cpu_dspark  # the wider GPU shape
    assert sum(gpu.values()) + standalone <= 62 * 2**20, (gpu, standalone)  # small files: < 2 MiB
    from specjax.training import build as build_module  # the sizes above, not computed again
    monkeypatch.setattr(build_module, "planned_bytes", lambda config, _: gpu[pathlib.Path(config).stem])
    calls = []
    for budget, ok in ((64.0, True), (30.0, False)):
        s = B.BuildSettings(target=str(target), out_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "w"),
                            config_dir=str(REPO / "configs" / "gpu"), drafters=names, eval_dir=str(tmp_path),
                            scale=B.SCALES["gpu"], budget_mb=budget)
        b = BS.program_build(s, runner=lambda st: calls.append(st) or 0, log=lambda m: None)
        if ok:
            b.check_sizes()
        else:
            with pytest.raises(BuildError, match=r"over the 30 MiB budget \(--budget-mb\): dspark 9\.\d MiB"):
                b.run(["train"])
    assert calls == []  # refused before any program ran


@pytest.mark.parametrize("budget_s", [300.0, None])
def test_with_a_budget_a_failed_unit_is_recorded_and_the_others_go_on(setup, tmp_path, budget_s):
    """One drafter's training fails (a child's exit status 1, as when it runs out of accelerator
    memory): with a budget the build records the error, trains the next drafter and then fails
    naming the unit; without one (control) it stops at the failure."""
    from specjax.training import build_plan as B
    from specjax.training.build_outputs import BuildError
    from train import build_stages as BS

    _seed_artifact(tmp_path / "a.jsonl.gz", [{"id": "p0", "turns": ["w10"]}])
    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "out"),
                        work_dir=str(tmp_path / "w"), config_dir=str(setup["configs"]),
                        drafters=("dspark", "mtp1"), eval_dir=str(setup["eval"]),
                        scale=B.SCALES["gpu"], budget_s=budget_s,
                        seed_answers=str(tmp_path / "a.jsonl.gz"))
    ran = []

    def runner(step):
        name = pathlib.Path(step.args[step.args.index("--config") + 1]).stem
        ran.append(name)
        return 1 if name == "dspark" else 0

    b = BS.program_build(s, runner=runner, log=lambda m: None)
    with pytest.raises(BuildError, match=r"train/dspark" if budget_s else "exit status 1"):
        b.run(["train"])
    stages = json.loads(pathlib.Path(s.record_path).read_text())["stages"]
    assert "exit status 1" in stages["train/dspark"]["last_error"]
    if budget_s:
        assert ran == ["dspark", "mtp1"] and "last_error" not in stages["train/mtp1"]
    else:
        assert ran == ["dspark"] and "train/mtp1" not in stages


def test_the_pack_is_written_when_a_stage_failed(setup, tmp_path, monkeypatch, capsys):
    from specjax.training.build_outputs import BuildError
    from train import build_embedded

    packed = []

    class FailingBuild:
        def run(self, stages):
            raise BuildError("unit(s) train/eagle3 failed")

    monkeypatch.setattr(build_embedded, "program_build", lambda *a, **k: FailingBuild())
    monkeypatch.setattr(build_embedded, "pack", lambda settings, d: packed.append(d) or {"files": {}})
    argv = _argv(setup, "--stages", "train", "--pack", str(tmp_path / "pack"), work=str(tmp_path / "w"),
                 out=str(tmp_path / "o"))
    assert build_embedded.main(argv) == 1
    assert packed == [str(tmp_path / "pack")] and "train/eagle3 failed" in capsys.readouterr().err


@pytest.mark.parametrize("curve_every", [200, 0])
def test_a_curve_without_table1_sets_is_refused_before_any_stage(setup, tmp_path, curve_every):
    """An evaluation directory without Table 1's sets (../shared not carried to the GPU machine)
    is refused naming --eval-dir before anything runs; without a curve (control) it is not."""
    import dataclasses

    from specjax.training import build_plan as B
    from specjax.training.build_outputs import BuildError
    from train import build_stages as BS

    bare = tmp_path / "eval"
    bare.mkdir()
    (bare / "set.jsonl").write_text(json.dumps({"turns": ["w1"]}) + "\n")
    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "out"),
                        work_dir=str(tmp_path / "w"), config_dir=str(setup["configs"]),
                        drafters=("dspark",), eval_dir=str(bare),
                        scale=dataclasses.replace(B.SCALES["gpu"], curve_every=curve_every))
    ran = []
    b = BS.program_build(s, runner=lambda st: ran.append(st) or 0, log=lambda m: None)
    if curve_every:
        with pytest.raises(BuildError, match=r"--eval-dir .*eval, which holds none of them"):
            b.run(["train"])
        assert ran == []
    else:
        with pytest.raises(BuildError, match="ended without completing"):  # the fake runner trains nothing
            b.run(["train"])
        assert [st.module for st in ran] == ["train.train_draft"]


def test_the_parent_starts_no_accelerator_and_records_the_childrens_machine(tmp_path):
    """With stages run as child processes the build's own process runs JAX on the CPU (a GPU's
    memory, of which JAX takes 75% when it starts, and a TPU, one process at a time, stay for the
    children) and BUILD.json records the machine a child sees, probed in a child."""
    import subprocess

    code = ("import json, os; os.environ.pop('JAX_PLATFORMS', None)\n"
            "from train import build_embedded as BE\n"
            "runner, machine = BE.children_setup()\n"
            "import jax\n"
            "print(json.dumps([jax.config.jax_platforms, machine(), machine() is machine()]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    platforms, probed, cached = json.loads(out.stdout.strip().splitlines()[-1])
    from specjax.training.build_record import machine

    assert platforms == "cpu" and cached
    assert probed == {**machine(), "platform": probed["platform"]}  # a child on this machine


def test_build_json_records_the_launchers_machine(setup, tmp_path):
    from specjax.training import build_plan as B
    from train import build_stages as BS

    s = B.BuildSettings(target=str(setup["target"]), out_dir=str(tmp_path / "out"),
                        work_dir=str(tmp_path / "w"), config_dir=str(setup["configs"]),
                        drafters=("mtp1",), eval_dir=str(setup["eval"]), scale=B.SCALES["gpu"],
                        budget_s=100.0)
    probed = {"jax_backend": "gpu", "device": "NVIDIA H200 (probed)"}
    b = BS.program_build(s, runner=lambda st: 0, log=lambda m: None, machine=lambda: probed)
    b.run(["train"])
    assert json.loads(pathlib.Path(s.record_path).read_text())["machine"] == probed
