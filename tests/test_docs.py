"""The layout the docs draw names what is in the sources: README's code layout line every
subpackage, docs/architecture.md's list of modules every module; and no file names a number of the
project's own tracker, which no reader can look up."""

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "nvrx_ipc_fix"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())

pytestmark = pytest.mark.once  # the sources and the docs: the same in every env


def test_readme_s_layout_line_names_every_subpackage():
    line = next(
        paragraph
        for paragraph in (ROOT / "README.md").read_text().split("\n\n")
        if paragraph.startswith("Code layout:")
    )
    assert [name for name in SUBPACKAGES if f"`{name}/`" not in line] == []


def test_the_architecture_page_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text.split("## The modules", 1)[1].split("```", 2)[1]
    blocks = dict(re.findall(r"^  (\w+)/ +(.*?)(?=^  \w+/|^src/_|\Z)", layout, re.M | re.S))
    assert sorted(blocks) == SUBPACKAGES
    missing = [
        f"{package}/{module.stem}.py"
        for package in SUBPACKAGES
        for module in sorted((PACKAGE / package).glob("*.py"))
        if module.stem != "__init__" and not re.search(rf"\b{module.stem}\b", blocks[package])
    ]
    assert missing == []


def test_the_architecture_page_shows_each_call_s_steps_as_the_table_orders_them():
    """docs/architecture.md's protocol table is ``targets.CALLS``: every call, its region and
    its steps in order."""
    from nvrx_ipc_fix.core.targets import CALLS

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \| (\w*) \| (.*?) \|$", text, re.M)
    assert rows == [(c.module, c.attr, c.region or "", " → ".join(c.order)) for c in CALLS.values()]


#: The word issue (or issues) and a number: with a space, a "#", a hyphen (a Markdown anchor)
#: or nothing between them.
TRACKER_NUMBER = re.compile(r"(?<![a-z])issues?[\s_-]*#?\d+", re.I)
#: An upstream project named right before the word: only that match is let through, never
#: the rest of its line.
UPSTREAM_ISSUE = re.compile(
    r"(?:Megatron-LM|Megatron-Bridge|megatron-core|NVRx|nvidia-resiliency-ext|NeMo RL|SkyRL)"
    r"(?:'s)? $",
    re.I,
)
#: Directories of the worktree that are not the project's (.gitignore's, git's own).
NOT_OURS = {"__pycache__", "build", "dist"}


def _project_files():
    for directory, subdirectories, files in os.walk(ROOT):
        subdirectories[:] = sorted(
            name
            for name in subdirectories
            if name not in NOT_OURS
            and not name.endswith(".egg-info")
            and (not name.startswith(".") or name == ".ci")
        )
        for name in sorted(files):
            yield pathlib.Path(directory, name)


def _ours(line):
    return [
        match.group()
        for match in TRACKER_NUMBER.finditer(line)
        if not UPSTREAM_ISSUE.search(line[: match.start()])
    ]


def test_no_file_names_a_number_of_our_own_tracker():
    """A section or comment says what it holds, not which ticket asked for it; an upstream
    project's issue keeps its number when its project is named right before it."""
    found = []
    for path in _project_files():
        data = path.read_bytes()
        if b"\0" in data:  # an image
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {text}" for text in _ours(line)]
    assert found == []


def test_the_tracker_check_sees_ours_beside_an_upstream_one():
    """The exclusion is per match: a line that names an upstream project still fails on ours.
    (The samples are built here, so that this file does not hold them.)"""
    word = "issue"
    line = (
        f"Megatron-LM {word} 6970 and NVRx's {word} #1 (theirs); {word} 36's rooms, "
        f"#{word}-35-one-h200, {word.title()}s #12, x2-faults-{word}36 (ours)"
    )
    assert _ours(line) == [f"{word} 36", f"{word}-35", f"{word.title()}s #12", f"{word}36"]
    assert _ours(f"github.com/NVIDIA/Megatron-LM/{word}s/6970") == []
