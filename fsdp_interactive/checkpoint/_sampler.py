"""A ``DistributedSampler`` that resumes mid-epoch, also on another number of ranks."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """torch's ``DistributedSampler`` with a position that checkpoints save per rank.

    The epoch order is ``DistributedSampler``'s (``randperm(len(dataset))`` seeded with
    ``seed + epoch``, or ``0..n-1`` without shuffling): it does not depend on the number
    of ranks. A pass over the epoch from position ``start`` gives rank ``r`` of ``R``
    ``order[start + r :: R]`` (the tail padded or, with ``drop_last``, cut to a multiple
    of ``R`` as ``DistributedSampler`` does), so from ``start=0`` it serves exactly what
    ``DistributedSampler`` serves.

    Position: the place in the epoch order of the next index this rank hands out. It
    counts the indices the sampler has handed out: with ``DataLoader(num_workers=0)``
    those are the samples of the batches the loop has received; worker processes
    prefetch, and what they prefetched counts as served (it is skipped after a resume).

    * ``state_dict()``: ``{"epoch", "position", "dataset_size", "seed", "shuffle",
      "drop_last"}``; ``load_state_dict`` checks the last four against this sampler
      (``ValueError``: another order) and makes the next pass start at the position.
    * ``reshard_state`` (world size changed): the new world starts at ``P``, the smallest
      saved position in the earliest saved epoch, and rank ``r`` continues at ``P + r``.
      Every sample before ``P`` in the epoch order was served before the save and is not
      served again; samples faster ranks had served beyond ``P`` are served again.
      When every rank was at the same step, nothing is served twice or skipped.
    * ``set_epoch(e)`` with a new epoch starts that epoch at position 0. A pass
      (``iter()``) continues from the position, so a loop that stopped early goes on
      where it stopped; a pass that starts on a finished epoch starts it over, as
      ``DistributedSampler`` repeats it. ``len()`` counts what is left of the epoch
      (all of it when it is finished).

    One iterator at a time: a new pass takes over the position from the previous one.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self._start = 0
        self._served = 0

    def _size(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _per_rank(self, left: int) -> int:
        if left <= 0:
            return 0
        if self.drop_last:
            return left // self.num_replicas
        return math.ceil(left / self.num_replicas)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self._size()))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self._size(), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        self._start += self._served * self.num_replicas
        self._served = 0
        if self._per_rank(self._size() - self._start) == 0:
            self._start = 0
        rest = self._order()[self._start :]
        total = self._per_rank(len(rest)) * self.num_replicas
        while len(rest) < total:
            rest += rest[: total - len(rest)]
        mine = rest[:total][self.rank :: self.num_replicas]
        for index in mine:
            self._served += 1
            yield index

    def __len__(self) -> int:
        left = self._per_rank(self._size() - self._start - self._served * self.num_replicas)
        return left if left else self._per_rank(self._size())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start, self._served = 0, 0
        super().set_epoch(epoch)

    def position(self) -> int:
        """Place in the epoch order of the next index this rank hands out."""
        return self._start + self.rank + self._served * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler is: epoch and position, with the settings a resume must match (dataset
        size, seed, shuffle, drop_last)."""
        return {
            "epoch": self.epoch,
            "position": self.position(),
            "dataset_size": self._size(),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position; settings that differ from this sampler's raise
        ``ValueError`` naming them."""
        for key, here in (
            ("dataset_size", self._size()),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if state_dict[key] != here:
                raise ValueError(
                    f"saved sampler has {key}={state_dict[key]!r}, this one {here!r}: "
                    "the epoch order would differ"
                )
        self.epoch = int(state_dict["epoch"])
        self._start = max(0, int(state_dict["position"]) - self.rank)
        self._served = 0

    def reshard_state(
        self, saved: Sequence[dict[str, Any]], rank: int, world_size: int
    ) -> dict[str, Any]:
        """The position for a new world size: every rank resumes the saved epoch from the earliest
        saved position, so no sample is skipped."""
        epoch = min(int(s["epoch"]) for s in saved)
        start = min(int(s["position"]) for s in saved if int(s["epoch"]) == epoch)
        return {**saved[0], "epoch": epoch, "position": start + rank}
