"""``fsdp-interactive checkpoint list / to-full / from-full`` on checkpoints written by
real ranks."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from fsdp_interactive import checkpoint as ck
from fsdp_interactive.cli import main
from tests.checkpoint import _common as c


def _train_and_save(root: str) -> dict:
    model = c.build("wrapper", seed=0)
    opt = c.optimizer(model)
    c.train_step(model, opt, 0)
    ck.save(f"{root}/step-1", model, opt, step=1)
    return c.full_values(model)


def _load_imported(path: str) -> dict:
    model = c.build("fsdp2", seed=8)
    report = ck.load(path, model)
    return {"values": c.full_values(model), "saved_world_size": report.saved_world_size}


def test_to_full_and_from_full_round_trip(ranks2, tmp_path, capsys):
    trained = ranks2.run(_train_and_save, str(tmp_path))[0]

    assert main(["checkpoint", "list", str(tmp_path)]) == 0
    header, rule, row = capsys.readouterr().out.splitlines()
    # The package's one table format: left-aligned columns two spaces apart, a dashed rule.
    assert header.startswith("name    step  world size  created (UTC)  ")
    assert [h.strip() for h in header.split("  ") if h] == [
        "name", "step", "world size", "created (UTC)", "size", "optimizer"
    ]  # fmt: skip
    assert rule.startswith("------  ----  ----------  ---------") and set(rule) == {"-", " "}
    assert row.startswith("step-1  1     2           20") and row.endswith("  yes")

    st_file, pt_file = tmp_path / "full.safetensors", tmp_path / "full.pt"
    assert main(["checkpoint", "to-full", str(tmp_path / "step-1"), str(st_file)]) == 0
    assert main(["checkpoint", "to-full", str(tmp_path / "step-1"), str(pt_file)]) == 0
    from_safetensors = load_file(str(st_file))
    from_torch = torch.load(pt_file, weights_only=True)
    assert c.max_diff(trained, from_safetensors) == 0.0
    assert c.max_diff(trained, from_torch) == 0.0
    plain = c.plain_model(seed=4)
    plain.load_state_dict(from_torch)  # strict: exactly the unwrapped model's keys

    donor = c.plain_model(seed=21)
    torch.save(donor.state_dict(), tmp_path / "donor.pt")
    imported = tmp_path / "imported"
    assert main(["checkpoint", "from-full", str(tmp_path / "donor.pt"), str(imported)]) == 0
    for r in ranks2.run(_load_imported, str(imported)):
        assert r["saved_world_size"] == 1
        assert c.max_diff(dict(donor.state_dict()), r["values"]) == 0.0


def test_cli_reports_bad_input_with_status_1(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a checkpoint")
    assert main(["checkpoint", "to-full", str(afile), str(tmp_path / "o.pt")]) == 1
    assert "is a file" in capsys.readouterr().err
    assert main(["checkpoint", "from-full", str(afile), str(tmp_path / "ck")]) == 1
    assert "not a readable state-dict file" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "o.pt").exists()
