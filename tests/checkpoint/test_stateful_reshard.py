"""LR scheduler, RNG and sampler state on real gloo ranks: saved at 2 ranks, loaded at 4,
saved again and loaded back at 2; a global state that differs between ranks is refused."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from fsdp_interactive import checkpoint as ck
from fsdp_interactive.checkpoint._rng import derived_seed
from tests.checkpoint import _common as c

SAMPLES = 48


def _draws() -> dict:
    return {
        "torch": torch.rand(3).tolist(),
        "python": random.random(),
        "numpy": float(np.random.rand()),
    }


def _setup(lr: float) -> tuple:
    model = c.build("fsdp2", seed=dist.get_world_size())
    opt = c.optimizer(model, "sgd")
    for group in opt.param_groups:
        group["lr"] = lr
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = ck.ResumableDistributedSampler(range(SAMPLES), seed=7)
    return model, opt, sched, sampler


def _batches(sampler, count: int) -> list[int]:
    loader = iter(DataLoader(range(SAMPLES), batch_size=2, sampler=sampler))
    return [i for _ in range(count) for i in next(loader).tolist()]


def _stateful(sched, sampler) -> dict:
    return {"lr_scheduler": sched, "rng": ck.RNGState(), "sampler": sampler}


def _save_at_2(root: str, same_seed: bool) -> dict:
    model, opt, sched, sampler = _setup(lr=0.1)
    sampler.set_epoch(1)
    for step in range(3):
        c.train_step(model, opt, step)
        sched.step()
    seed = 5 if same_seed else 100 + dist.get_rank()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    served = _batches(sampler, 3)  # 6 samples per rank: positions 0..11 of the epoch
    rng_at_save = ck.RNGState().state_dict()
    ck.save(f"{root}/w2", model, opt, step=3, stateful=_stateful(sched, sampler))
    return {
        "served": served,
        "rng_at_save": rng_at_save,
        "draws_after_save": _draws(),
        "sched": sched.state_dict(),
    }


def _load_then_save(root: str, source: str, target: str) -> dict:
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("fsdp_interactive.checkpoint")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        model, opt, sched, sampler = _setup(lr=0.9)
        torch.manual_seed(999)
        report = ck.load(f"{root}/{source}", model, opt, stateful=_stateful(sched, sampler))
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    out = {
        "report": report,
        "sched": sched.state_dict(),
        "lr": [g["lr"] for g in opt.param_groups],
        "draws": _draws(),
        "epoch": sampler.epoch,
        "log": records,
    }
    out["served"] = _batches(sampler, 2)  # 2 batches per rank more, then save
    ck.save(f"{root}/{target}", model, opt, step=4, stateful=_stateful(sched, sampler))
    out["draws_after_save"] = _draws()
    out["rest"] = list(sampler)
    return out


def _expected_grown_draws(saved_state: dict, rank: int) -> dict:
    seed = derived_seed(saved_state, rank)
    return {
        "torch": torch.rand(3, generator=torch.Generator().manual_seed(seed)).tolist(),
        "python": random.Random(seed).random(),
        "numpy": float(np.random.RandomState(seed % 2**32).rand()),
    }


def test_scheduler_rng_and_sampler_go_from_2_to_4_ranks_and_back(ranks2, ranks4, tmp_path):
    root = str(tmp_path)
    at2 = ranks2.run(_save_at_2, root, False)
    at4 = ranks4.run(_load_then_save, root, "w2", "w4")
    back = ranks2.run(_load_then_save, root, "w4", "w2again")

    for r in at4 + back:
        assert r["report"].loaded_stateful == ["lr_scheduler", "rng", "sampler"]
        assert r["lr"] == [0.05, 0.05]  # the saved groups' lrs (0.1 halved once), not 0.9
        assert r["epoch"] == 1
    for r in at4:
        assert r["sched"] == at2[0]["sched"]
        assert r["report"].saved_world_size == 2 and r["report"].world_size == 4
        assert "stateful 'rng': rank" in "\n".join(r["log"])
        assert any("resharded from 2 saved ranks to 4" in m for m in r["log"])
        assert any("saved by 2 ranks" in m and "(resharding)" in m for m in r["log"])
    for r in back:
        assert r["sched"] == at2[0]["sched"]  # the 4 ranks did not step it
        assert any("resharded from 4 saved ranks to 2" in m for m in r["log"])

    # RNG 2 -> 4: ranks 0 and 1 continue their streams; 2 and 3 start derived ones.
    assert [r["draws"] for r in at4[:2]] == [r["draws_after_save"] for r in at2]
    for rank in (2, 3):
        assert at4[rank]["draws"] == _expected_grown_draws(at2[rank % 2]["rng_at_save"], rank)
    assert len({str(r["draws"]) for r in at4}) == 4
    # RNG 4 -> 2: ranks 0 and 1 continue the 4-rank world's streams of ranks 0 and 1.
    assert [r["draws"] for r in back] == [r["draws_after_save"] for r in at4[:2]]
    # Sampler: every sample of the epoch exactly once over the three worlds.
    served = [i for r in at2 for i in r["served"]]
    served += [i for r in at4 for i in r["served"]]
    served += [i for r in back for i in r["served"] + r["rest"]]
    assert sorted(served) == list(range(SAMPLES))


def _draws_after_load(root: str) -> dict:
    rng = ck.RNGState()
    torch.manual_seed(999)
    model = c.build("fsdp2")
    ck.load(f"{root}/w2", model, stateful={"rng": rng})
    return _draws()


def test_rng_seeded_alike_stays_alike_on_4_ranks_and_continues_on_2(ranks2, ranks4, tmp_path):
    root = str(tmp_path)
    at2 = ranks2.run(_save_at_2, root, True)
    assert at2[0]["draws_after_save"] == at2[1]["draws_after_save"]
    for r in ranks4.run(_draws_after_load, root):
        assert r == at2[0]["draws_after_save"]
    assert ranks2.run(_draws_after_load, root) == [r["draws_after_save"] for r in at2]


class RankCounter:
    """A global Stateful by its methods, but with another state on each rank."""

    def state_dict(self) -> dict:
        return {"count": dist.get_rank()}

    def load_state_dict(self, state: dict) -> None:
        pass


def _save_divergent(root: str) -> str:
    try:
        ck.save(f"{root}/bad", c.build("fsdp2"), stateful={"counter": RankCounter()})
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_global_state_that_differs_between_ranks_is_refused_on_every_rank(ranks2, tmp_path):
    for message in ranks2.run(_save_divergent, str(tmp_path)):
        assert "stateful['counter'] has another state on rank(s) [1] than on rank 0" in message
    assert list(tmp_path.iterdir()) == []
