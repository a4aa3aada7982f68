"""Every figure in benchmarks/README.md can be traced to the run it came from.

A figure is kept only with its run's record (benchmarks/_record.py): the results file
committed beside it, naming the commit, the machine and how loaded it was. A link to a
record that is not there, or not committed, or a section that states figures without
one, would be a figure nobody can check.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
README = BENCHMARKS / "README.md"
MOST_LINES = 300
"""The README is a reference, not a diary (#66)."""
RECORD_LINK = re.compile(r"\]\((results/[^)\s]+\.json)\)")
"""A markdown link to a results file, relative to benchmarks/."""


def _linked_records() -> list[str]:
    return RECORD_LINK.findall(README.read_text())


def test_the_readme_stays_a_reference():
    lines = README.read_text().count("\n")
    assert lines <= MOST_LINES, f"benchmarks/README.md has {lines} lines (at most {MOST_LINES})"


def test_every_linked_record_is_there_and_says_what_it_ran_on():
    linked = _linked_records()
    assert linked, "benchmarks/README.md links no results file"
    for link in linked:
        path = BENCHMARKS / link
        assert path.is_file(), f"benchmarks/README.md links {link}, which is not there"
        record = json.loads(path.read_text())
        machine = record.get("machine", {})
        assert machine.get("commit") and machine.get("cores") and "load_before" in record, \
            f"{link} does not say which commit and machine it ran on, or how loaded"


def test_every_linked_record_is_committed():
    git = shutil.which("git")
    root = BENCHMARKS.parent
    if git is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = set(subprocess.run([git, "ls-files", "benchmarks/results"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.split())
    untracked = [link for link in _linked_records() if f"benchmarks/{link}" not in tracked]
    assert not untracked, f"records linked but not committed: {untracked}"


def test_every_section_with_figures_names_its_record():
    """A section's ``Latest:`` paragraph, where figures are stated, links its record."""
    for section in re.split(r"^## ", README.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0]
        for paragraph in re.findall(r"^Latest\b.*?(?:\n\n|\Z)", section, re.M | re.S):
            assert RECORD_LINK.search(paragraph), \
                f"section {title!r}: figures without the record they came from"
