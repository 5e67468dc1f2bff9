"""`python -m serve.server`: the same program as `specjax-serve` (see `specjax.cli.serve`)."""
import sys

from specjax.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
