"""`make test` runs the real-target tests under xdist's --dist loadgroup so that the tests of one
shipped drafter (and those comparing with transformers) keep to one worker, which builds that
engine once. Some pytest releases (9.2: pytest-dev/pytest-xdist#1386) make xdist ignore the
xdist_group mark without a word; this catches such an upgrade."""
import re
import subprocess
import sys

GROUPED = '''
import pytest

@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    pass

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    pass
'''


def workers_by_test(output: str) -> dict[str, str]:
    """test node id -> the xdist worker that ran it, from `pytest -v` output."""
    return {m.group(2): m.group(1) for m in re.finditer(r"^\[(gw\d+)\] .*? PASSED (\S+)", output, re.M)}


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", "test_grouped.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ran = workers_by_test(run.stdout)
    assert len(ran) == 8, run.stdout[-2000:]
    grouped = {t: w for t, w in ran.items() if "test_grouped[" in t}
    assert all(t.endswith("@one") for t in grouped), f"the group mark was ignored: {sorted(grouped)}"
    assert len(set(grouped.values())) == 1, grouped


def test_worker_parser_reads_verbose_lines():
    out = "[gw0] [ 50%] PASSED a.py::t[0]@one \n[gw1] [100%] PASSED a.py::t[1] \n"
    assert workers_by_test(out) == {"a.py::t[0]@one": "gw0", "a.py::t[1]": "gw1"}
