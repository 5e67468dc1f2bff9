"""experiments.run: every variant is a valid config, the comparison's verdicts, the record, refusals."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import yaml

from experiments import run


def _results(base: str, new: str, tau_new: float, *, seed: int) -> dict:
    """A two-drafter evaluation: `base` at τ 1.30 and `new` at `tau_new` on the same 40 prompts of
    varied difficulty."""
    hard = np.random.default_rng(seed).uniform(0.5, 1.5, 40)

    def entry(tau):
        req = {f"p{i}": [10, int(round(10 * tau * hard[i]))] for i in range(40)}
        return {"datasets": {"all": {"requests": req}}, "overall": {"accept_rate": [tau - 1.0]}, "macro": tau}
    return {"drafters": {base: entry(1.30), new: entry(tau_new)}}


@pytest.mark.parametrize("name", sorted(run.VARIANTS))
def test_every_variant_is_its_base_config_with_its_overrides(name, tmp_path):
    """Each variant changes a shipped config by `--set` overrides that name existing fields, and the
    written config loads as a training config holding them."""
    from specjax import default_target as dt
    from specjax.training.config import load_train_config

    v = run.VARIANTS[name]
    assert v.base in dt.DRAFTER_NAMES and v.sets
    path = run.write_config(name, str(tmp_path))
    cfg = load_train_config(path)
    base = load_train_config(f"configs/embedded/{v.base}.yaml")
    assert cfg != base
    written = yaml.safe_load(open(path, encoding="utf-8"))
    for item in v.sets:
        key, value = item.split("=", 1)
        section, field = key.split(".")
        assert written[section][field] == yaml.safe_load(value), item


def test_comparison_verdicts_and_record():
    """A variant 10% better on every prompt is shown better, the same τ is not, 10% worse is worse;
    the record names its command and the overrides."""
    args = argparse.Namespace(cap=8, max_tokens=64, replicates=500)
    for tau, want in ((1.43, "better"), (1.30, "no difference shown"), (1.17, "worse")):
        s = run.comparison(_results("dspark", "dspark-long", tau, seed=5), "dspark", "dspark-long", replicates=500)
        assert s["ratio"]["value"] == pytest.approx(tau / 1.30, abs=0.02)
        assert run.verdict(s["ratio"]) == want
        md = run.report("dspark-long", {"0": s}, args, "python -m experiments.run dspark-long")
        assert md.startswith("# Experiment dspark-long") and "`schedule.total_steps=1440`" in md
        assert "Command: `python -m experiments.run dspark-long`" in md
        assert next(line for line in md.splitlines() if line.startswith("| 0 |")).rstrip(" |").endswith(want)


def test_build_command_reuses_the_shipped_work_dir_and_compare_names_the_build(tmp_path, monkeypatch):
    cmd = run.build_command("dspark-lr3", "cfgs")
    assert cmd[1:3] == ["-m", "train.build_embedded"]
    assert cmd[cmd.index("--work-dir") + 1] == run.WORK_DIR and cmd[cmd.index("--drafters") + 1] == "dspark-lr3"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="experiments.run dspark-lr3 --stages build"):
        run.main(["dspark-lr3", "--stages", "compare"])


def test_list_names_every_variant(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in run.VARIANTS)
