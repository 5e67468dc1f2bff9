"""The library's structure goals (`bench.code_structure`): the import layers of docs/DESIGN.md,
modules <= 500 lines, functions <= 60 lines. The checkers are tested on planted cases (the negative
controls), so a passing library check means the rule was looked for."""
from __future__ import annotations

import pytest

from bench.code_structure import (MAX_FUNCTION_LINES, MAX_MODULE_LINES, function_lengths, library_sources,
                                  violations)


def test_library_follows_the_import_layers():
    found = [v for mod, src in library_sources() for v in violations(mod, src)]
    assert not found, "\n".join(found)


def test_modules_and_functions_stay_small():
    big = [f"{mod}: {len(src.splitlines())} lines" for mod, src in library_sources()
           if len(src.splitlines()) > MAX_MODULE_LINES]
    long = [f"{mod}.{name}: {n} lines" for mod, src in library_sources()
            for name, n in function_lengths(src) if n > MAX_FUNCTION_LINES]
    assert not big and not long, big + long


def test_function_lengths_count_methods_and_nested_functions():
    src = "class A:\n    def f(self):\n        def g():\n            return 1\n        return g\n\n\ndef h():\n    pass\n"
    assert sorted(function_lengths(src)) == [("A.f", 4), ("A.f.g", 2), ("h", 2)]


@pytest.mark.parametrize("module,source,needle", [
    ("specjax.scheduling.policies", "import jax\n", "imports jax"),
    ("specjax.scheduling.planner", "def f():\n    from specjax.eval.metrics import ece\n", "specjax.eval.metrics"),
    ("specjax.drafters.dspark", "from specjax.training.data import block_positions\n", "specjax.training.data"),
    ("specjax.drafters.dspark", "from ..training import data\n", "specjax.training.data"),
    ("specjax.models.decoder", "from specjax.drafters import common\n", "specjax.drafters.common"),
    ("specjax.decoding.engine", "import specjax.serving.metrics\n", "specjax.serving.metrics"),
    ("specjax.training.build", "import train.train_draft\n", "imports train.train_draft"),
    ("specjax.training.build", "STEP = ('train.train_draft', [])\n", "names the program train.train_draft"),
])
def test_rule_checker_catches_planted_violations(module, source, needle):
    found = violations(module, source)
    assert any(needle in v for v in found), found


def test_rule_checker_allows_downward_imports():
    ok = ("import numpy as np\nfrom specjax.config import ConfigError\n"
          "from specjax.sampling import sample\nfrom specjax.models import cache\n")
    assert violations("specjax.drafters.dspark", ok) == []
    assert violations("specjax.decoding.engine", "from specjax.drafters.base import DraftBlock\n") == []
    assert violations("specjax.scheduling.policies", "import numpy as np\n\n'''see `train.train_draft` docs'''\n") == []
