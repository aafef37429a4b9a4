"""benchmarks/RESULTS.md is the report of the committed JSON (benchmarks/report.py)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report  # noqa: E402  (benchmarks/ is not a package)


def test_the_committed_results_are_the_report_of_the_committed_json():
    # after changing benchmarks/results/ or compile_reports/: python benchmarks/report.py
    assert (BENCHMARKS / "RESULTS.md").read_text() == report.render()


def test_every_results_file_is_a_section_with_command_machine_and_date():
    names = {s.name for s in report.SECTIONS}
    for path in sorted(report.RESULTS.glob("*.json")):
        assert path.stem in names, f"{path.name} is no section of report.SECTIONS"
        result = json.loads(path.read_text())
        assert result["command"].startswith("python benchmarks/"), path.name
        assert result["machine"] and result["date"] and result["tables"], path.name
        for table in result["tables"]:
            assert all(len(row) == len(table["columns"]) for row in table["rows"]), path.name


def test_every_runnable_section_names_a_script_that_exists():
    for section in report.SECTIONS:
        assert (section.argv or section.generate) and not (section.argv and section.generate), (
            section.name
        )
        if section.argv:
            assert (BENCHMARKS / section.argv[0]).exists(), section.name


def test_printed_tables_round_trip_through_the_parser():
    text = (
        "backend cpu, 1 device(s)\n| a | b c |\n| --- | --- |\n| 1 | x |\n| 2 | y |\n"
        "trailing line\n| not a table |\n\n| k |\n|---|\n| v |\n"
    )
    tables = report.parse_tables(text)
    assert tables == [
        {"columns": ["a", "b c"], "rows": [["1", "x"], ["2", "y"]]},
        {"columns": ["k"], "rows": [["v"]]},
    ]
    assert (
        report.parse_tables(report.markdown_table(["a", "b c"], [["1", "x"], ["2", "y"]]))
        == tables[:1]
    )


@pytest.mark.parametrize(
    "section", [s for s in report.SECTIONS if s.generate is None], ids=lambda s: s.name
)
def test_a_section_without_its_json_says_how_to_make_it(section, monkeypatch, tmp_path):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    assert f"python benchmarks/run_all.py --only {section.name}" in report.render_section(section)
