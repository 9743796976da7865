"""Views of ranks on several hosts show where one host's ranks end and the next begin;
views of one host look as they always did."""

from __future__ import annotations

import re

import pytest
from matplotlib.lines import Line2D

from fsdp_interactive.inspect import ModelLayout, ParamLayout, RankTotals, ShardSlice
from fsdp_interactive.notebook.plots import layout_figure
from fsdp_interactive.notebook.render import (
    render_layout,
    render_topology,
)
from fsdp_interactive.pool.common._topology import RankRecord


def _layout(hosts: list[str]) -> ModelLayout:
    """A (16, 4) weight sharded row-wise over one rank per entry of ``hosts``."""
    world = len(hosts)
    rows = 16 // world
    slices = tuple(
        ShardSlice(
            rank=r,
            local_shape=(rows, 4),
            offset=(rows * r, 0),
            numel=4 * rows,
            padded_numel=4 * rows,
        )
        for r in range(world)
    )
    param = ParamLayout(
        fqn="w",
        global_shape=(16, 4),
        dtype="float32",
        element_size=4,
        is_dtensor=True,
        placements=("Shard(dim=0)",),
        mesh_shape=(world,),
        mesh_dim_names=("shard",),
        requires_grad=True,
        slices=slices,
    )
    totals = tuple(RankTotals(r, 16 * rows, 0, 0, 0, host) for r, host in enumerate(hosts))
    return ModelLayout(world_size=world, params=(param,), ranks=totals)


TWO_HOSTS = ["hosta"] * 4 + ["hostb"] * 4


def _rank_table(text: str) -> list[list[str]]:
    """The rows (split on runs of spaces) of the bytes-per-rank table, the last table."""
    table = text.split("\n\n")[-1].splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in table]


def test_the_text_names_each_hosts_ranks_once():
    text = render_layout(_layout(TWO_HOSTS)).text()
    assert "over 8 ranks on 2 hosts: hosta r0-3, hostb r4-7" in text
    table = _rank_table(text)
    assert table[0][:2] == ["host", "rank"]
    body = table[2:]
    assert [row[0] for row in body if not row[0].startswith("rank")] == ["hosta", "hostb"]
    assert body[0][:2] == ["hosta", "rank 0"] and body[4][:2] == ["hostb", "rank 4"]
    assert all(row[0].startswith("rank") for i, row in enumerate(body) if i not in (0, 4))


def test_the_html_names_each_hosts_ranks_once():
    html = render_layout(_layout(TWO_HOSTS)).html()
    assert "on 2 hosts: hosta r0-3, hostb r4-7" in html
    assert ">host</th>" in html
    assert html.count(">hosta</td>") == 1 and html.count(">hostb</td>") == 1


@pytest.mark.parametrize("hosts", [["hosta"] * 8, [""] * 8])
def test_one_host_or_unknown_hosts_show_no_host_labels(hosts):
    text = render_layout(_layout(hosts)).text()
    assert "hosts" not in text and "over 8 ranks\n" in text + "\n"
    assert _rank_table(text)[0][0] == "rank"
    assert ">host</th>" not in render_layout(_layout(hosts)).html()
    memory = layout_figure(_layout(hosts)).axes[1]
    assert not [line for line in memory.lines if isinstance(line, Line2D)]
    assert not [t.get_text() for t in memory.texts]


def test_the_figure_separates_hosts_and_labels_them_at_eight_ranks():
    memory = layout_figure(_layout(TWO_HOSTS)).axes[1]
    separators = [line.get_xdata()[0] for line in memory.lines]
    assert separators == [3.5]  # between rank 3 (hosta) and rank 4 (hostb)
    labels = {t.get_text(): t.get_position()[0] for t in memory.texts}
    assert labels == {"hosta": 1.5, "hostb": 5.5}
    top = max(p.get_y() + p.get_height() for p in memory.patches)
    assert memory.get_ylim()[1] > top  # room above the bars for the labels


def test_a_long_host_name_is_cut_to_its_bars_width():
    hosts = ["node-with-a-very-long-name-01"] + ["node-02"] * 7
    labels = [t.get_text() for t in layout_figure(_layout(hosts)).axes[1].texts]
    assert labels[0] == "nod\u2026" and labels[1] == hosts[1]


def _records(hosts: list[str]) -> list[RankRecord]:
    local = {h: 0 for h in hosts}
    records = []
    for rank, host in enumerate(hosts):
        records.append(
            RankRecord(rank, local[host], len(hosts), host, 100 + rank, "cpu", "gloo", rank, "")
        )
        local[host] += 1
    return records


def test_status_heads_the_rank_table_with_each_hosts_ranks():
    records = _records(["hosta", "hosta", "hostb"])
    text = render_topology(records).text()
    assert text.splitlines()[0] == "2 hosts: hosta r0-1, hostb r2"
    assert "<b>2 hosts: hosta r0-1, hostb r2</b>" in render_topology(records).html()
    single = render_topology(_records(["hosta", "hosta"])).text()
    assert single.splitlines()[0].startswith("rank") and "hosts:" not in single
