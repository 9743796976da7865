"""The one text-table format of the package (``_text.text_table``) and its users' output."""

from __future__ import annotations

import pytest

from fsdp_interactive._text import text_table
from fsdp_interactive.pool.common._topology import RankRecord, format_table


def test_columns_are_left_aligned_two_spaces_apart_under_a_dashed_rule():
    table = text_table(("a", "long header", "c"), [(1, "x", None), ("wide cell", 2.5, "")])
    assert table.splitlines() == [
        "a          long header  c",
        "---------  -----------  ----",
        "1          x            None",
        "wide cell  2.5",  # no trailing spaces, also for an empty last cell
    ]


def test_cells_are_shown_as_the_caller_formatted_them():
    """Number-like text is not parsed, re-formatted or realigned."""
    rows = [("1.50", "1e3", "nan", "007"), (1.5, 1000.0, float("nan"), 7)]
    assert text_table(("a", "b", "c", "d"), rows).splitlines()[2:] == [
        "1.50  1e3     nan  007",
        "1.5   1000.0  nan  7",
    ]


def test_no_rows_still_shows_the_headers():
    assert text_table(("rank", "host"), []) == "rank  host\n----  ----"


def test_a_ragged_row_is_refused_by_index():
    with pytest.raises(ValueError, match=r"rows\[1\] has 1 cells; the table has 2 headers"):
        text_table(("a", "b"), [(1, 2), (3,)])


def test_the_topology_table_keeps_its_layout():
    records = [
        RankRecord(r, r % 2, 4, "host-a" if r < 2 else "b", 10 + 1000 * r, "cpu", "gloo", r, "x")
        for r in range(3)
    ] + [RankRecord(3, 1, 4, "b", 3010, "cuda:1", "nccl", 3, "x", visible_devices="1,3")]
    assert format_table(records).splitlines() == [
        "rank  local_rank  host    pid   device           backend  engine_id",
        "----  ----------  ------  ----  ---------------  -------  ---------",
        "0     0           host-a  10    cpu              gloo     0",
        "1     1           host-a  1010  cpu              gloo     1",
        "2     0           b       2010  cpu              gloo     2",
        "3     1           b       3010  cuda:1 (of 1,3)  nccl     3",
    ]
    assert format_table([]).splitlines()[0].startswith("rank  local_rank  host")


def test_a_long_list_is_cut_to_its_first_few_and_a_count():
    from fsdp_interactive._text import first_few

    assert first_few(["a", "b", "c", "d"]) == "a; b; c; d"
    assert first_few([f"t{i}" for i in range(28)]) == "t0; t1; t2; and 25 more"
    assert first_few(["a", "b", "c"], 1, ", ") == "a, and 2 more"


def test_did_you_mean_names_the_close_matches_or_nothing():
    from fsdp_interactive._text import did_you_mean

    assert did_you_mean("modle", ["model", "optim", "rank"]) == "did you mean 'model'?"
    assert did_you_mean("modle", ["model", "moddle", "mode", "x"]) == (
        "did you mean 'moddle', 'mode' or 'model'?"  # closest first (difflib's ratio)
    )
    assert did_you_mean("zzz", ["model"]) == ""
