"""bench/RESULTS.md stays a page of today's figures: short, a headline table that leads to every section, and each
section saying how and when its figures were measured (older ones live in the file's git history)."""

from __future__ import annotations

import re
from pathlib import Path

from .test_names import markdown_anchors

RESULTS = Path(__file__).parents[2] / "bench" / "RESULTS.md"
MAX_LINES = 250
COMMAND = re.compile(r"`(?:[A-Z_]+=\S* )*(?:python|torchrun|bash|pytest|PYTHONPATH=|NCCL_)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_file_holds_at_most_250_lines():
    lines = RESULTS.read_text().count("\n")
    assert lines <= MAX_LINES, f"bench/RESULTS.md has {lines} lines (at most {MAX_LINES}: drop superseded figures)"


def test_the_headline_table_comes_first_and_leads_to_every_section():
    text = RESULTS.read_text()
    head = text.split("\n## ", 1)[0]
    assert "| feature | headline | device, date |" in head
    linked = set(re.findall(r"\]\(#([^)]+)\)", head))
    anchors = markdown_anchors(text)
    assert linked <= anchors, f"headline links to no section: {sorted(linked - anchors)}"
    missing = [s for s in _sections(text) if markdown_anchors(f"## {s}") & linked == set()]
    assert not missing, f"sections the headline table does not lead to: {missing}"


def test_every_section_gives_its_command_and_date():
    wrong = [s for s, body in _sections(RESULTS.read_text()).items() if not (COMMAND.search(body) and DATE.search(body))]
    assert not wrong, f"sections without a command or a date: {wrong}"
