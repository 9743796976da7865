"""The slice a recovery replays, decided from the cells' code and what the ranks saw: the
rules of ``pool/_slice.py`` and ``pool/_cell_effects.py`` on the cells of training notebooks
(no ranks needed: the journal is plain data)."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool._cell_effects import effects_of
from fsdp_interactive.pool._journal import Journal
from fsdp_interactive.pool._slice import slice_for

BUILD = """
import torch
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.examples import TinyTransformer
torch.manual_seed(0)
model = FSDP(TinyTransformer())
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
"""
TRAIN = """
for step in range(3):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
print(loss.item())
"""
SAVE = 'checkpoint.save(root + "/step-3", model, optim, step=3)'
LOAD = 'checkpoint.load(root + "/step-3", model, optim)'
SNAPSHOT = "fsdp_interactive.snapshot(model=model, optimizer=optim, step=3)"
NAMES = {"model": "model", "optimizer": "optim", "stateful": {}}


def journal_of(*cells: str | tuple[str, bool | None]) -> tuple[Journal, list]:
    """A journal whose entries ran ``cells`` in order (``(source, replay)`` for a marked
    one), every one successfully; the entries."""
    journal = Journal()
    journal.new_epoch()
    entries = []
    for number, cell in enumerate(cells, start=1):
        source, replay = cell if isinstance(cell, tuple) else (cell, None)
        entry = journal.begin(source, cell=number, replay=replay)
        journal.finish(entry, "ok")
        entries.append(entry)
    return journal, entries


def parts_of(*cells, names=NAMES, snapshot_cell: int | None = None) -> dict[int, str]:
    """``{cell: its line}`` of a recovery to a snapshot taken in the last cell (or in cell
    ``snapshot_cell``)."""
    journal, entries = journal_of(*cells)
    taker = entries[-1] if snapshot_cell is None else entries[snapshot_cell - 1]
    sliced = slice_for(journal.replay_for(taker.id), names)
    return {p.entry.cell: p.line() for p in sliced.parts}


def replayed(parts: dict[int, str]) -> list[int]:
    return [cell for cell, line in parts.items() if "skipped" not in line]


def test_the_issue_notebook_replays_only_the_build_cell():
    parts = parts_of(BUILD, TRAIN, "root = tempfile.mkdtemp()", SAVE, LOAD, SNAPSHOT)
    assert replayed(parts) == [1]
    assert parts[1] == "In[1] defines model, optim"
    for cell in (2, 4, 5):
        assert (
            parts[cell] == f"In[{cell}] skipped: uses model, optim, whose state the snapshot holds"
        )
    assert parts[3] == "In[3] skipped: defines nothing the snapshot needs"


def test_a_hook_is_replayed_and_a_training_step_is_not():
    hook = "handle = model.register_forward_hook(lambda module, args, out: None)"
    freeze = "for p in model.embed.parameters():\n    p.requires_grad = False"
    moved = "model.half()"
    parts = parts_of(BUILD, TRAIN, hook, freeze, moved, "optim.step()", SNAPSHOT)
    assert replayed(parts) == [1, 3, 4, 5]
    assert parts[3] == "In[3] changes model (model.register_forward_hook())"
    assert parts[4] == "In[4] changes model (sets p.requires_grad)"
    assert parts[5] == "In[5] changes model (model.half())"
    assert parts[6] == "In[6] skipped: uses optim, whose state the snapshot holds"


def test_what_the_build_reads_is_replayed_and_changes_to_it_before_the_build():
    config = "config = {'layers': 2}"  # a constant: replayed as a definition anyway
    loaded = "config = load_config('small.json')"
    tweak = "config['layers'] = 4"
    build = "model = build(config)\noptim = torch.optim.AdamW(model.parameters())"
    late = "config['layers'] = 8"  # after the build: it cannot matter
    parts = parts_of(
        config, loaded, tweak, build, late, "def build(c):\n    return Net(c)", SNAPSHOT
    )
    assert parts[2] == "In[2] defines config (read by In[4])"
    assert parts[3] == "In[3] changes config (sets config[...])"
    assert parts[4] == "In[4] defines model, optim"
    assert parts[5] == "In[5] skipped: defines nothing the snapshot needs"
    # In[2] binds config on every path: In[1]'s binding cannot matter, yet it costs nothing.
    assert "only imports and defines" in parts[1]
    # In[6] defines build after In[4] ran: kept, as it only defines.
    assert replayed(parts) == [1, 2, 3, 4, 6]


def test_a_name_bound_again_later_makes_the_earlier_binding_irrelevant():
    first = "model = Net(width=8)\nmodel.train_for(100)"
    second = "model = Net(width=16)\noptim = torch.optim.SGD(model.parameters(), lr=0.1)"
    parts = parts_of(first, second, SNAPSHOT)
    assert replayed(parts) == [2]
    assert parts[1] == "In[1] skipped: uses model, whose state the snapshot holds"
    conditional = "if rank == 0:\n    model = Net(width=8)\nelse:\n    model = Net(width=8)"
    parts = parts_of(first, conditional, "optim = torch.optim.SGD(model.parameters())", SNAPSHOT)
    assert replayed(parts) == [1, 2, 3]  # a binding under `if` might not happen


def test_replay_flags_force_a_cell_in_or_keep_it_out():
    side = "import os\nos.makedirs(out_dir, exist_ok=True)\nlog = open(out_dir + '/log', 'a')"
    parts = parts_of((side, True), (BUILD, False), SNAPSHOT)
    assert parts[1] == "In[1] forced by %%fsdp --replay"
    assert parts[2] == "In[2] skipped: marked %%fsdp --no-replay"


def test_definition_cells_are_kept_without_what_their_functions_read():
    helpers = (
        "import hashlib\nLR = 3e-4\nSCALE = LR * 2\n"
        "def step(batch):\n    return data_loader.next(), model(batch)\n"
        "class Box:\n    width = 2\n"
    )
    data = "data_loader = make_loader()"  # only the helper's body reads it
    parts = parts_of(BUILD, data, helpers, SNAPSHOT)
    assert parts[3].startswith("In[3] only imports and defines functions, classes and constants")
    assert parts[2] == "In[2] skipped: defines nothing the snapshot needs"
    assert effects_of(helpers).definitions_only
    assert not effects_of(data).definitions_only
    # A cell that calls the helper makes what its body reads needed.
    calling = "model = step(batch)[1]\noptim = torch.optim.SGD(model.parameters())"
    parts = parts_of(data, helpers, calling, SNAPSHOT)
    assert replayed(parts) == [1, 2, 3]
    assert parts[2] == "In[2] defines step (read by In[3])"


def test_process_settings_are_replayed():
    cells = (
        "torch.set_default_dtype(torch.float64)",
        "import sys\nsys.path.insert(0, src)",
        "import os\nos.environ['HF_HOME'] = cache",
        "torch.manual_seed(1)",  # the journal keeps the generators: not a setting
        BUILD,
        SNAPSHOT,
    )
    parts = parts_of(*cells)
    assert parts[1] == "In[1] changes the process (torch.set_default_dtype())"
    assert parts[2] == "In[2] changes the process (sys.path.insert())"
    assert parts[3] == "In[3] changes the process (sets os.environ[...])"
    assert parts[4] == "In[4] skipped: defines nothing the snapshot needs"
    assert replayed(parts) == [1, 2, 3, 5]


def test_what_the_ranks_saw_counts_where_the_code_does_not_say():
    journal, entries = journal_of(
        "def build():\n    global model\n    model = Net()",
        "build()",  # rebinds model: only the ranks see it
        "optim = torch.optim.SGD(model.parameters())",
        "attach_probes(model)",  # registers hooks inside a helper
        "evaluate(model)",
        SNAPSHOT,
    )
    journal.note_cell({"kind": "cell", "call": entries[1].id, "rank": 0, "rebound": ["model"]})
    journal.note_cell(
        {"kind": "cell", "call": entries[3].id, "rank": 1, "reshaped": {"model": "hooks (0 -> 2)"}}
    )
    sliced = slice_for(journal.replay_for(entries[-1].id), NAMES)
    lines = {p.entry.cell: p.line() for p in sliced.parts}
    assert lines[2] == "In[2] defines model (seen after it ran)"
    assert lines[4] == "In[4] changes model (its hooks (0 -> 2), seen after it ran)"
    assert lines[5] == "In[5] skipped: uses model, whose state the snapshot holds"
    # The cell that declares `global model` defines it too (and only defines).
    assert "In[1]" in lines[1] and "skipped" not in lines[1]
    assert [e.cell for e in sliced.replay] == [1, 2, 3, 4]


def test_attribute_paths_make_their_root_needed_and_a_framework_call_is_not_replayed():
    setup = (
        "trainer = Trainer(model=net, args=args, train_dataset=data)\ntrainer.create_optimizer()"
    )
    cells = ("net = Net()", "data = Tokens()\nargs = Args()", setup, "trainer.train()", SNAPSHOT)
    names = {"model": "trainer.model_wrapped", "optimizer": "trainer.optimizer", "stateful": {}}
    parts = parts_of(*cells, names=names)
    assert parts[3] == "In[3] defines trainer"
    assert parts[4] == "In[4] skipped: uses trainer, whose state the snapshot holds"
    assert replayed(parts) == [1, 2, 3]
    assert parts[1] == "In[1] defines net (read by In[3])"


def test_without_recorded_locations_every_candidate_is_replayed():
    parts = parts_of(BUILD, TRAIN, (SAVE, False), SNAPSHOT, names={"model": None})
    assert replayed(parts) == [1, 2]
    assert "does not say where its objects live" in parts[2]
    assert parts[3] == "In[3] skipped: marked %%fsdp --no-replay"


def test_a_cell_that_does_not_parse_is_replayed():
    odd = "model = Net(\n"  # a syntax error even after IPython lines are blanked
    parts = parts_of(BUILD, odd, SNAPSHOT)
    assert "its code could not be read" in parts[2]


@pytest.mark.parametrize(
    ("source", "defines", "kills", "reads"),
    [
        ("x = y + 1", {"x"}, {"x"}, {"y"}),
        ("x += 1", {"x"}, set(), {"x"}),
        (
            "for i, (a, b) in enumerate(pairs):\n    total = a",
            {"i", "a", "b", "total"},
            set(),
            {"pairs"},
        ),
        ("with open(p) as fh:\n    text = fh.read()", {"fh", "text"}, {"fh", "text"}, {"p"}),
        ("try:\n    v = f()\nexcept E as e:\n    v = 0", {"v", "e"}, set(), {"f", "E"}),
        ("[n := k for k in ks]", {"n"}, set(), {"ks"}),
        ("y = [k * w for k in ks]", {"y"}, {"y"}, {"ks", "w"}),
        ("f = lambda z: z + w\nf(1)", {"f"}, {"f"}, {"w"}),
        ("a = 1\nb = a", {"a", "b"}, {"a", "b"}, set()),
        ("%time x = 1\n!ls\ny = x", {"y"}, {"y"}, {"x"}),
    ],
)
def test_cell_effects_read_from_the_code(source, defines, kills, reads):
    fx = effects_of(source)
    assert set(fx.defines) == defines
    assert set(fx.kills) == kills
    assert set(fx.reads) == reads


def test_the_example_of_docs_recovery_md():
    cells = (
        "import torch, tempfile\n"
        "from fsdp_interactive import checkpoint\n"
        "config = GPT2Config(n_layer=12)\n"
        "model = FSDP(GPT2LMHeadModel(config), auto_wrap_policy=policy)\n"
        "optim = torch.optim.AdamW(model.parameters(), lr=3e-4)\n",
        "probe = model.register_forward_hook(record_activations)",
        "for step in range(100): train_step(step)",
        'root = tempfile.mkdtemp()\ncheckpoint.save(root + "/step-100", model, optim)',
        "fsdp_interactive.snapshot(model=model, optimizer=optim, step=100)",
    )
    assert list(parts_of(*cells).values()) == [
        "In[1] defines model, optim",
        "In[2] changes model (model.register_forward_hook())",
        "In[3] skipped: defines nothing the snapshot needs",
        "In[4] skipped: uses model, optim, whose state the snapshot holds",
    ]
