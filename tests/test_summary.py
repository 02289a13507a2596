"""The summary each pytest session prints (``conftest.pytest_terminal_summary``), which
``scripts/test`` shows for every env, and the progress lines it prints meanwhile."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

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
    """ "all N tests" is passed + skipped, a module skipped at collection included (it was
    one less in every env with tests/test_ray.py skipped)."""
    session = tmp_path / "session"
    session.mkdir()
    (session / "pytest.ini").write_text("[pytest]\n")
    for name, text in TESTS_OF_A_SESSION.items():
        (session / name).write_text(text)
    summary = tmp_path / "summary.txt"
    env = {
        "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
        "NVRX_TESTS_SUMMARY": str(summary),
    }
    # as tox runs each env: conftest's hooks, xdist's controller writing the summary
    rc, out, err = run_process(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-n",
            "1",
            "--dist",
            "load",
            str(session),
        ],
        env=env,
        fresh=True,
    )
    assert rc == 0, out + err
    assert "1 passed, 2 skipped" in out, out
    lines = summary.read_text().splitlines()
    assert lines[0].startswith("pytest -p conftest ") and lines[0].endswith(str(session)), lines
    assert lines[1].startswith("tests: 1 passed, 2 skipped in "), lines
    assert lines[-1].endswith(" all 3 tests"), lines


ROOT = Path(TESTS).parent
TOOLS = ROOT / ".venv-tools" / "bin" / "tox"  # scripts/test makes it (tox and tox-uv)
#: A project of two envs that stand for the matrix's: each writes its summary as pytest does
#: (to the terminal and to $NVRX_TESTS_SUMMARY) for two pytest runs, as the megatron env
#: does; ``fails`` exits 1, and ``waits`` ends only once scripts/test's output has
#: shown a progress line naming it (or fails after 60 s).
PROJECT = {
    "tox.ini": "[tox]\nenvlist = waits, fails\n\n[testenv]\nskip_install = true\n"
    "pass_env = OUTPUT\nset_env = NVRX_TESTS_SUMMARY = {envtmpdir}/summary.txt\n"
    "commands = python {toxinidir}/env.py {envname}\n",
    "env.py": textwrap.dedent("""
        import os, sys, time

        name = sys.argv[1]
        for run in ("first", "second"):
            summary = f"pytest {run} run of {name}\\ntests: 1 passed of {name}"
            print(summary)
            with open(os.environ["NVRX_TESTS_SUMMARY"], "a") as out:
                out.write(summary + "\\n")
        deadline = time.monotonic() + 60
        while name == "waits" and f"running: {name} (" not in open(os.environ["OUTPUT"]).read():
            if time.monotonic() > deadline:
                sys.exit("no progress line in 60 s")
            time.sleep(0.1)
        sys.exit(name == "fails")
    """),
}


@pytest.mark.once
@pytest.mark.skipif(not TOOLS.exists(), reason="no .venv-tools here (scripts/test makes it)")
def test_scripts_test_shows_progress_and_each_summary_once_under_its_heading(tmp_path):
    """While envs run, a line names them with their time; an env that passed is followed by
    its summary, each pytest run under its heading; a failed env's summary is in its own
    output, which tox shows, once."""
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test", tmp_path / "scripts" / "test")
    shutil.copy(ROOT / "toxfile.py", tmp_path / "toxfile.py")
    (tmp_path / ".venv-tools").symlink_to(TOOLS.parent.parent)
    output = tmp_path / "output.txt"
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("TOX_") and key != "VIRTUAL_ENV"
    }
    env.update(OUTPUT=str(output), NVRX_TESTS_PROGRESS="0.5")
    with open(output, "w") as out:
        rc = subprocess.run(
            [str(tmp_path / "scripts" / "test")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=180,
        ).returncode
    text = output.read_text()
    assert rc != 0 and "running: waits (" in text, text  # the failed env fails the run
    waits = text[text.index("waits: ended after") :]
    assert (
        waits.startswith("waits: ended after")
        and "(ok)\npytest first run of waits\n"
        "tests: 1 passed of waits\npytest second run of waits\ntests: 1 passed of waits\n"
        in waits
    ), text
    for run in ("first", "second"):
        assert text.count(f"pytest {run} run of waits") == 1, text
        assert text.count(f"pytest {run} run of fails") == 1, text
