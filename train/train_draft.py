"""Train a drafter: `python -m train.train_draft` is `specjax-train` (`specjax.cli.train`)."""
from specjax.cli.train import main

if __name__ == "__main__":
    raise SystemExit(main())
