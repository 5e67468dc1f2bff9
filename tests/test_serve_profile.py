"""`python -m serve.profile`: the README's command (no --policy) measures the cost table of a
cost-aware engine and writes it; a server engine given that file starts with it (its metadata
matches) instead of measuring. Bad input stops at parsing, naming the flag: a policy that reads no
cost table (before: it compiled every program, then failed on a bucket its policy never compiles),
no drafter, a table given to the program that measures one, an output directory that is missing."""
import pathlib

import pytest
from flax import nnx

from serve import profile
from specjax.scheduling import CostTable

from serving_fixtures import export_tiny_target

GAMMA = 3
ENGINE = ["--max-num-seqs", "2", "--max-model-len", "64", "--max-prefill", "16", "--slots-buckets", "1,2",
          "--tokens-buckets", "1,2,4", "--prefill-buckets", "16", "--attention-buckets", "64",
          "--sampling-variants", "greedy", "--max-logprobs", "0"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from specjax import checkpoints
    from specjax.drafters.dspark import BlockDrafterConfig, make_block_drafter
    from specjax.drafters.registry import save_drafter

    root = tmp_path_factory.mktemp("profile")
    target = export_tiny_target(root / "target")
    model, tcfg = checkpoints.load_target(target)
    cfg = BlockDrafterConfig.from_target(tcfg, target_layer_ids=(0, 1), mask_token_id=3, num_draft_layers=1,
                                         block_size=GAMMA, markov_rank=8, confidence_head=True)
    drafter = save_drafter(make_block_drafter(model, tcfg, cfg, nnx.Rngs(0)), root / "dspark", target_config=tcfg)
    return root, str(target), str(drafter)


def test_default_policy_writes_a_table_a_server_engine_accepts(models, capsys):
    root, target, drafter = models
    out = root / "cost.json"
    profile.main(["--target", target, "--drafter", drafter, "--out", str(out), *ENGINE])
    printed = capsys.readouterr().out
    assert "policy confidence_async" in printed
    table = CostTable.from_json(out)
    assert sorted(table.as_dict()) == [(s, t) for s in (1, 2) for t in (1, 2, 4)]
    assert all(v > 0 for v in table.as_dict().values())
    assert table.meta.timed_round == "fused_fill"
    old = table.to_dict()
    del old["meta"]["timed_round"]  # a table written before the field: a draft-and-verify round
    assert CostTable.from_dict(old).meta.timed_round == "draft+verify"
    from specjax.serving.cli import build_llm
    args = profile.parse_args(["--target", target, "--drafter", drafter, "--out", str(root / "unused.json"),
                               *ENGINE])
    args.cost_table = str(out)
    llm = build_llm(args)
    assert llm.engine.cost_table.as_dict() == table.as_dict()  # loaded, not measured again
    # a table times the round of its policy: the synchronous confidence policy's engine refuses it
    args.policy = "confidence"
    with pytest.raises(ValueError, match="timed_round: table has 'fused_fill', engine has 'draft\\+verify'"):
        build_llm(args)


@pytest.mark.parametrize("extra, flag", [
    (["--policy", "fixed"], "--policy fixed reads no cost table"),
    (["--drafter", None], "--drafter is required"),
    (["--cost-table", "t.json"], "--cost-table"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--out", "missing/dir/cost.json"], "its directory does not exist"),
    (["--engine-config", "fixed.yaml"], "--policy fixed reads no cost table"),  # the YAML's policy counts
    (["--engine-config", "fixed.yaml", "--policy", "confidence"], "differs from the policy of --engine-config"),
    (["--engine-config", "missing.yaml"], "--engine-config"),
])
def test_bad_input_stops_at_parsing_naming_the_flag(models, extra, flag, capsys):
    root, target, drafter = models
    argv = {"--target": target, "--drafter": drafter, "--out": str(root / "c.json")}
    argv.update(dict(zip(extra[::2], extra[1::2])))
    if argv["--out"].startswith("missing"):
        argv["--out"] = str(pathlib.Path(root) / argv["--out"])
    (root / "fixed.yaml").write_text("max_slots: 2\nmax_len: 64\npolicy: fixed\n")
    if "--engine-config" in argv:
        argv["--engine-config"] = str(root / argv["--engine-config"])
    with pytest.raises(SystemExit) as e:
        profile.parse_args([x for k, v in argv.items() if v is not None for x in (k, v)])
    assert e.value.code == 2 and flag in capsys.readouterr().err
