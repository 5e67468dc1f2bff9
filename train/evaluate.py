"""Evaluate drafters with the DSpark Table-1 protocol: `python -m train.evaluate` is `specjax-eval`
(`specjax.cli.evaluate`)."""
from specjax.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
