"""The analytic engine against the committed GPU measurements of the HF recipe (bench/results/hf_recipe/)."""

import os
import re

import pytest

from fitune.profile.accuracy import compare, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "bench", "results", "hf_recipe", "hf_recipe.jsonl")
ROWS = compare(MEASURED)


def test_enough_cases_over_enough_architectures():
    assert len(ROWS) >= 40
    assert len({r.label.split()[0] for r in ROWS}) >= 4


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_within_3pct_allocated_and_5pct_reserved(row):
    assert abs(row.allocated_error_pct) <= 3.0, row
    assert abs(row.reserved_error_pct) <= 5.0, row


def test_readme_error_table_matches_the_measurements():
    s = summary(ROWS)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"\| peak allocated \| (\d+) \| ([\d.]+) % \| ([\d.]+) % \|", readme)
    n = re.search(r"\| peak reserved \| (\d+) \| ([\d.]+) % \| ([\d.]+) % \|", readme)
    assert m and n, "README lacks the error table"
    assert int(m.group(1)) == s["cases"] == int(n.group(1))
    assert (m.group(2), m.group(3)) == (f"{s['allocated_median_pct']:.2f}", f"{s['allocated_max_pct']:.2f}")
    assert (n.group(2), n.group(3)) == (f"{s['reserved_median_pct']:.2f}", f"{s['reserved_max_pct']:.2f}")
