"""Measure the cost table of an engine under a cost-aware policy and save it as JSON.

    python -m serve.profile --drafter dspark --out cost_table.json
    python -m serve.server --drafter dspark --policy confidence_async --cost-table cost_table.json

The table is what the engine's warm-up measures under `--policy` (default confidence_async: a fused
draft-and-fill round per bucket; confidence: a draft call plus a verify call), so a server given it
starts without measuring. `--repeats N` measures it again with N timed calls per bucket.
"""
from __future__ import annotations

import argparse
import pathlib

from specjax.serving.cli import add_llm_args, build_llm

PROFILED_POLICIES = ("confidence", "confidence_async")  # the policies that read a cost table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llm_args(ap)
    ap.add_argument("--out", required=True, help="where to write the cost table JSON")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measure again with this many timed calls per bucket (default: the warm-up's table)")
    args = ap.parse_args(argv)
    if args.engine_config is not None:  # the YAML's policy is the engine's (it replaces the shape flags)
        from specjax.config import ConfigError, load_yaml
        from specjax.decoding.engine import EngineConfig
        try:
            yaml_policy = load_yaml(EngineConfig, args.engine_config).policy
        except (ConfigError, OSError, ValueError) as e:
            ap.error(f"--engine-config {args.engine_config}: {e}")
        if args.policy not in (None, yaml_policy):
            ap.error(f"--policy {args.policy} differs from the policy of --engine-config ({yaml_policy})")
        args.policy = yaml_policy
    args.policy = args.policy or "confidence_async"
    if args.policy not in PROFILED_POLICIES:
        ap.error(f"--policy {args.policy} reads no cost table; serve.profile measures one for "
                 f"{' or '.join(PROFILED_POLICIES)}")
    if args.drafter is None:
        ap.error("--drafter is required: a cost table prices drafting rounds")
    if args.cost_table is not None:
        ap.error("--cost-table: serve.profile measures the table; pass it to the serving programs instead")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not pathlib.Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: its directory does not exist")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    llm = build_llm(args, progress=True)  # the warm-up measures the table
    table = llm.engine.cost_table
    if args.repeats is not None:
        from specjax.decoding.profiling import measure_cost_table
        table = measure_cost_table(llm.engine, repeats=args.repeats, progress=True)
    table.to_json(args.out)
    print(f"wrote {args.out} (policy {args.policy})")
    for (sb, tb), sec in sorted(table.as_dict().items()):
        print(f"slots {sb:4d} tokens {tb:3d}: {sec * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
