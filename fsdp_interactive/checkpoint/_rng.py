"""The random number generators of one process as a per-rank Stateful."""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy


def state_digest(state: Any) -> bytes:
    """SHA-256 over a nested state (tensors by dtype, shape and bytes; keys sorted)."""
    digest = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            digest.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
            digest.update(obj.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(obj, dict):
            digest.update(b"{")
            for key in sorted(obj, key=repr):
                digest.update(repr(key).encode())
                feed(obj[key])
            digest.update(b"}")
        elif isinstance(obj, (list, tuple)):
            digest.update(b"[")
            for item in obj:
                feed(item)
            digest.update(b"]")
        else:
            digest.update(repr(obj).encode())

    feed(state)
    return digest.digest()


def derived_seed(saved_state: Any, rank: int) -> int:
    """The seed a rank without a saved counterpart starts from (63 bits, deterministic)."""
    digest = hashlib.sha256(state_digest(saved_state) + f"rank:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RNGState:
    """This process's random number generators, saved and restored per rank.

    ``state_dict()`` holds the torch CPU generator (``torch.get_rng_state()``), the generator
    of this rank's own CUDA device, the current one (``"cuda_device"``; by default only when
    CUDA is already initialised in this process, so that saving never initialises it;
    ``cuda=True`` always, ``cuda=False`` never), Python's ``random`` (``python=True``) and
    NumPy's legacy global generator (``numpy``: by default when NumPy is installed).
    Generators owned by other objects (a ``torch.Generator`` given to a DataLoader) and the
    generators of the host's other GPUs (other ranks' devices, saved by those ranks) are not
    included.

    ``load_state_dict`` sets the generators the state holds; the saved CUDA state goes to
    this rank's current device, whatever its index was at save time (a rank that sees its
    GPU under another index after a restart, e.g. through ``CUDA_VISIBLE_DEVICES``, keeps
    its stream). On a process without CUDA it is skipped. States saved by earlier versions
    (``"cuda"``: every device's generator by index) restore the entry of the current
    device's index only.

    Resharding (``reshard_state``, used when the world size changed), for rank ``r`` of
    the new world with ``N`` saved states:

    * every rank saved the same state (all ranks seeded alike): every rank gets it, so
      identical streams stay identical;
    * ``r < N``: rank ``r`` continues the stream rank ``r`` saved (going 4 -> 2, ranks
      0 and 1 continue theirs; the streams of saved ranks 2 and 3 end);
    * ``r >= N`` (going 2 -> 4, ranks 2 and 3): every generator is seeded with
      :func:`derived_seed` of saved rank ``r % N``'s state and ``r`` (``torch.manual_seed``,
      which seeds the CPU and every CUDA generator; ``random.seed``; NumPy with the seed
      modulo 2**32). Deterministic, and different from every other rank's stream.
    """

    def __init__(self, *, cuda: bool | None = None, python: bool = True, numpy: bool | None = None):
        if cuda and not torch.cuda.is_available():
            raise ValueError(
                "RNGState(cuda=True) needs CUDA, but torch.cuda.is_available() is False"
            )
        if numpy and _numpy() is None:
            raise ValueError("RNGState(numpy=True) needs NumPy, which is not installed")
        self.cuda = cuda
        self.python = python
        self.numpy = _numpy() is not None if numpy is None else numpy

    def _with_cuda(self) -> bool:
        return torch.cuda.is_initialized() if self.cuda is None else self.cuda

    def state_dict(self) -> dict[str, Any]:
        """This rank's generator states: torch's CPU generator, the current CUDA device's where
        there is one, and Python's and NumPy's when asked for."""
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self._with_cuda():
            state["cuda_device"] = torch.cuda.get_rng_state("cuda")  # the current device
        if self.python:
            state["python"] = random.getstate()
        if self.numpy:
            name, keys, pos, has_gauss, cached = _numpy().random.get_state()
            state["numpy"] = {
                "name": str(name),
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators to a saved state (or seed them, when the state is a seed)."""
        if "seed" in state_dict:
            self._seed(int(state_dict["seed"]))
            return
        torch.set_rng_state(state_dict["torch"])
        if self.cuda is not False:
            if "cuda_device" in state_dict:
                self._set_cuda(state_dict["cuda_device"], None)
            elif "cuda" in state_dict:
                self._set_cuda(None, state_dict["cuda"])
        if "python" in state_dict and self.python:
            version, internal, gauss = state_dict["python"]
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in state_dict and self.numpy:
            saved = state_dict["numpy"]
            np = _numpy()
            keys = saved["keys"].numpy().astype(np.uint32)
            np.random.set_state(
                (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
            )

    @staticmethod
    def _set_cuda(own: torch.Tensor | None, by_index: Sequence[torch.Tensor] | None) -> None:
        """Set the current CUDA device's generator: to ``own``, or to its index's entry of
        ``by_index`` (the format that saved every device). No other device is touched."""
        if not torch.cuda.is_available():
            logger.info("no CUDA here: the saved CUDA generator state is skipped")
            return
        if own is not None:
            # "cuda": the current device, also when CUDA initialises only later (torch defers).
            torch.cuda.set_rng_state(own, "cuda")
            return
        assert by_index is not None
        index = torch.cuda.current_device()
        if index >= len(by_index):
            logger.info("%d saved CUDA generator states, none for device %d", len(by_index), index)
            return
        torch.cuda.set_rng_state(by_index[index], index)

    def _seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self.python:
            random.seed(seed)
        if self.numpy:
            _numpy().random.seed(seed % 2**32)

    def reshard_state(
        self, saved: Sequence[dict[str, Any]], rank: int, world_size: int
    ) -> dict[str, Any]:
        """The saved states for a new world size: one state shared by every rank stays shared; per-
        rank states go to the ranks that saved them, and new ranks get a seed derived from them."""
        first = state_digest(saved[0])
        if all(state_digest(s) == first for s in saved[1:]):
            return saved[0]
        if rank < len(saved):
            return saved[rank]
        return {"seed": derived_seed(saved[rank % len(saved)], rank)}
