"""The layout the docs draw names what is in the sources: README's code layout line every
subpackage, docs/architecture.md's rooms every module."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "nvrx_ipc_fix"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())

pytestmark = pytest.mark.once  # the sources and the docs: the same in every env


def test_readme_s_layout_line_names_every_subpackage():
    line = next(paragraph for paragraph in (ROOT / "README.md").read_text().split("\n\n")
                if paragraph.startswith("Code layout:"))
    assert [name for name in SUBPACKAGES if f"`{name}/`" not in line] == []


def test_the_architecture_page_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    layout = text.split("## The rooms", 1)[1].split("```", 2)[1]
    blocks = dict(re.findall(r"^  (\w+)/ +(.*?)(?=^  \w+/|^src/_|\Z)", layout, re.M | re.S))
    assert sorted(blocks) == SUBPACKAGES
    missing = [f"{package}/{module.stem}.py" for package in SUBPACKAGES
               for module in sorted((PACKAGE / package).glob("*.py"))
               if module.stem != "__init__"
               and not re.search(rf"\b{module.stem}\b", blocks[package])]
    assert missing == []


def test_the_architecture_page_shows_each_call_s_steps_as_the_table_orders_them():
    """docs/architecture.md's protocol table is ``targets.CALLS``: every call, its region and
    its steps in order."""
    from nvrx_ipc_fix.core.targets import CALLS

    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \| (\w*) \| (.*?) \|$", text, re.M)
    assert rows == [(c.module, c.attr, c.region or "", " → ".join(c.order))
                    for c in CALLS.values()]
