"""The DCP metadata unpickler takes what CPython's own enum pickling produces on every
release from 3.10 to 3.13, whichever runs here, and nothing more.

CPython pickles an enum member either as a call of its class with the value (3.10,
most 3.11 and 3.12+ releases) or as ``getattr(EnumClass, "NAME")`` (3.11.0 to 3.11.x
releases such as Debian 12's 3.11.2, and ``enum.pickle_by_enum_name``). Both forms are
written here explicitly, so the test holds on any interpreter; the genuine snapshots of
the system-Python lane (``make test-system-python``) check the real thing.
"""

from __future__ import annotations

import copyreg
import enum
import io
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch

from fsdp_interactive.checkpoint._format import _safe_reader
from fsdp_interactive.checkpoint.errors import CorruptCheckpointError

ENCODING = _safe_reader._allowed_globals()[
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
]


class _Other(enum.Enum):
    """An enum the metadata never holds."""

    A = 1


def _pickled(obj: object, by_name: bool) -> bytes:
    """``obj`` pickled with every enum member as ``getattr(cls, name)`` (``by_name``) or
    as ``cls(value)``, as the CPython releases do."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, value: object) -> object:
            if isinstance(value, enum.Enum):
                if by_name:
                    return getattr, (type(value), value.name)
                return type(value), (value.value,)
            return NotImplemented

    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _load(data: bytes) -> object:
    return _safe_reader._MetadataUnpickler(io.BytesIO(data)).load()


@pytest.mark.parametrize("by_name", [False, True], ids=["by value", "by name (getattr)"])
def test_enum_members_of_the_metadata_load_both_ways(by_name):
    members = list(ENCODING)
    assert _load(_pickled(members, by_name)) == members
    # What this interpreter's own pickling makes loads too.
    assert _load(pickle.dumps(members)) == members


def test_this_interpreters_own_metadata_pickle_loads():
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

    properties = TensorProperties.create_from_tensor(torch.zeros(2))
    metadata = Metadata(state_dict_metadata={})
    data = pickle.dumps((metadata, properties))
    loaded_metadata, loaded = _load(data)
    assert isinstance(loaded_metadata, Metadata) and loaded.dtype == torch.float32
    assert loaded.memory_format == torch.contiguous_format


def _getattr_pickle(target: object, name: object) -> bytes:
    """A pickle that calls ``getattr(target, name)``."""

    class Call:
        def __reduce__(self) -> tuple:
            return getattr, (target, name)

    return pickle.dumps(Call(), protocol=pickle.HIGHEST_PROTOCOL)


@pytest.mark.parametrize(
    ("target", "name", "words"),
    [
        (torch.Size, "__reduce__", "getattr is allowed on the metadata's enum classes only"),
        (Path, "home", "getattr is allowed on the metadata's enum classes only"),
        (ENCODING, "__class__", "not the name of one of its members"),
        (ENCODING, "_member_map_", "not the name of one of its members"),
        (ENCODING, 3, "not the name of one of its members"),
    ],
)
def test_getattr_is_refused_for_anything_but_a_member_of_an_allowed_enum(target, name, words):
    with pytest.raises(pickle.UnpicklingError, match=words):
        _load(_getattr_pickle(target, name))


def test_an_enum_the_metadata_never_holds_is_refused(tmp_path):
    copyreg.pickle(_Other, lambda member: (getattr, (_Other, member.name)))
    try:
        data = pickle.dumps(_Other.A)
    finally:
        copyreg.dispatch_table.pop(_Other)
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        _load(data)
    # Through a file, the error names the file.
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: cannot read DCP metadata"):
        _safe_reader.read_metadata(tmp_path)


def _pickled_from(module: str, cls: type, value: object, monkeypatch) -> bytes:
    """``value`` pickled as pickle would when ``cls`` lived in ``module``."""
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, module, types.SimpleNamespace(**{cls.__name__: cls}))
        patch.setattr(cls, "__module__", module)
        return pickle.dumps(value)


def test_a_raw_extent_pickled_under_its_earlier_module_loads(monkeypatch):
    """Snapshots persisted before the format's modules moved name the raw format's extent
    by its earlier module; they still read back, as the same class."""
    from fsdp_interactive.checkpoint._format._raw_storage import RawExtent

    extent = RawExtent("__0_0.distcp", 16, 8)
    earlier = _pickled_from(_safe_reader._EARLIER_RAW_STORAGE, RawExtent, extent, monkeypatch)
    assert _safe_reader._EARLIER_RAW_STORAGE.encode() in earlier
    assert _load(earlier) == extent == _load(pickle.dumps(extent))
    # A module of the package that never held it is refused.
    elsewhere = _pickled_from("fsdp_interactive.checkpoint._load", RawExtent, extent, monkeypatch)
    with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
        _load(elsewhere)
