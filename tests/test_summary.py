"""The summary each pytest session prints (``conftest.pytest_terminal_summary``), which
``scripts/test`` shows for every env."""

import os
import sys

import pytest

from conftest import TESTS, run_process

TESTS_OF_A_SESSION = {
    "test_run.py": "import pytest\n\n"
                   "def test_passes():\n    pass\n\n"
                   "@pytest.mark.skip(reason='skipped as it runs')\n"
                   "def test_skipped():\n    pass\n",
    # skipped at collection, as tests/test_ray.py is in every env without Ray
    "test_module_skipped.py": "import pytest\n\n"
                              "pytest.skip('no such thing here', allow_module_level=True)\n\n"
                              "def test_never_collected():\n    pass\n",
}


@pytest.mark.once  # the harness's own output: the same with any NVRx and wrapt
def test_the_summary_counts_every_outcome_pytest_counts(tmp_path):
    """"all N tests" is passed + skipped, a module skipped at collection included (it was
    one less in every env with tests/test_ray.py skipped)."""
    session = tmp_path / "session"
    session.mkdir()
    (session / "pytest.ini").write_text("[pytest]\n")
    for name, text in TESTS_OF_A_SESSION.items():
        (session / name).write_text(text)
    summary = tmp_path / "summary.txt"
    env = {"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
           "NVRX_TESTS_SUMMARY": str(summary)}
    # as tox runs each env: conftest's hooks, xdist's controller writing the summary
    rc, out, err = run_process([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                                "no:cacheprovider", "-q", "-n", "1", "--dist", "load",
                                str(session)], env=env, fresh=True)
    assert rc == 0, out + err
    assert "1 passed, 2 skipped" in out, out
    lines = summary.read_text().splitlines()
    assert lines[0].startswith("tests: 1 passed, 2 skipped in "), lines
    assert lines[-1].endswith(" all 3 tests"), lines
