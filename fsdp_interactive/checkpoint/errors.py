"""Exceptions raised by :mod:`fsdp_interactive.checkpoint`.

Every error is raised on *all* ranks of a collective save or load (the ranks agree on
the verdict before raising), so a notebook cell fails as a whole instead of leaving some
ranks blocked in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error."""


class CheckpointPathError(CheckpointError, ValueError):
    """The path given to save/load/list is unusable (a file, not writable, missing, taken)."""


class UnsupportedModelError(CheckpointError, TypeError):
    """The model is wrapped in a way whose sharded state torch cannot checkpoint; the
    message names the wrapping and how to build one that it can. Nothing was written."""


class CheckpointBusyError(CheckpointError):
    """A save was requested while another save of this process is still running."""


class SnapshotError(CheckpointError):
    """A snapshot in host memory cannot be taken, found or restored as asked (it does not
    exist, it is incomplete on the hosts that remain, or a name it recorded is gone).

    Raised on every rank; the snapshots already published are left as they were.
    """


class SnapshotObjectsError(SnapshotError):
    """The objects a snapshot holds cannot all be found where it recorded them (a
    variable, or an attribute path such as ``trainer.optimizer``): when it is taken, an
    object that is neither a variable nor an attribute of one; when it is restored, a name
    that is not defined, an attribute that is ``None``, or an object of the wrong kind.

    ``missing`` lists the keywords (``"model"``, ``"optimizer"``, stateful keywords)
    concerned. Nothing was written or loaded.
    """

    def __init__(self, message: str, missing: list[str] | None = None):
        super().__init__(message)
        self.missing = list(missing or [])

    def __reduce__(self) -> tuple:  # keeps ``missing`` across ranks (all_gather pickles)
        return (type(self), (str(self), self.missing))


class SnapshotSpaceError(SnapshotError):
    """The snapshot folder of a host lacks the room a new snapshot needs there.

    ``host``, ``folder``, ``needed`` and ``free`` (bytes) describe the first such host.
    Nothing was written; the previous snapshots are kept.
    """

    def __init__(
        self, message: str, *, host: str = "", folder: str = "", needed: int = 0, free: int = 0
    ):
        super().__init__(message)
        self.host, self.folder, self.needed, self.free = host, folder, needed, free

    def __reduce__(self):  # keep the numbers when the error travels between ranks
        return (
            _rebuild_space,
            (type(self), str(self), self.host, self.folder, self.needed, self.free),
        )


def _rebuild_space(cls, message, host, folder, needed, free):
    return cls(message, host=host, folder=folder, needed=needed, free=free)


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated, altered or unreadable.

    ``file`` names the offending file. Nothing has been written into the model or the
    optimizer when this is raised.
    """

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file

    def __reduce__(self):  # keep ``file`` when the error travels between ranks
        return (type(self), (str(self), self.file))


class UntrustedCheckpointError(CorruptCheckpointError):
    """A checkpoint this user cannot vouch for: not sealed with this user's checkpoint key
    (another user's, an older version's, or planted by someone who recomputed its
    checksums), or lying where another user could change it. ``file`` names the file or
    folder. The message says how to load it anyway once it is known to be the user's
    (``trusted=True``, ``fsdp_interactive.checkpoint.trust``). Nothing was loaded.
    """


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint does not fit the model/optimizer it is loaded into.

    Carries the offending keys so callers (and the notebook panel) can show them.
    Nothing has been written into the model or the optimizer when this is raised.
    """

    def __init__(
        self,
        message: str,
        *,
        missing_keys: Sequence[str] = (),
        unexpected_keys: Sequence[str] = (),
        shape_mismatches: Sequence[str] = (),
    ):
        super().__init__(message)
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        self.shape_mismatches = list(shape_mismatches)

    def __reduce__(self):  # keep the key lists when the error travels between ranks
        return (
            _rebuild_incompatible,
            (type(self), str(self), self.missing_keys, self.unexpected_keys, self.shape_mismatches),
        )


def _rebuild_incompatible(cls, message, missing, unexpected, shapes):
    return cls(message, missing_keys=missing, unexpected_keys=unexpected, shape_mismatches=shapes)
