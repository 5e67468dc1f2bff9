"""`python -m serve.batch`: the same program as `specjax-batch` (see `specjax.cli.batch`)."""
import sys

from specjax.cli.batch import main

if __name__ == "__main__":
    sys.exit(main())
