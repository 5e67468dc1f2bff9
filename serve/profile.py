"""Measure the verify cost table of an engine and save it as JSON.

    python -m serve.profile --target DIR --drafter dspark --out cost_table.json
"""
from __future__ import annotations

import argparse

from specjax.serving.cli import add_llm_args, build_llm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llm_args(ap)
    ap.add_argument("--out", required=True, help="where to write the cost table JSON")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    llm = build_llm(args, progress=True)
    from specjax.decoding.profiling import measure_cost_table
    table = measure_cost_table(llm.engine, repeats=args.repeats, progress=True)
    table.to_json(args.out)
    print(f"wrote {args.out}")
    for (sb, tb), sec in sorted(table.as_dict().items()):
        print(f"slots {sb:4d} tokens {tb:3d}: {sec * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
