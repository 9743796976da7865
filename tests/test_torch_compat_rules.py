"""The rules around ``fsdp_interactive._torch_compat``: no module of the package reaches a
private torch name except through it, and the torch range ``pyproject.toml`` admits is the
one its entries were checked on (and the one CI runs). The entries themselves are
exercised by ``tests/test_torch_compat.py``, on every torch CI covers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from fsdp_interactive import _torch_compat as compat

PACKAGE = Path(compat.__file__).parent

# ---------------------------------------------------------------------------- the rule

# Attributes of torch objects (reached through instances, so not visible from imports):
# the package reads them only through the compat module.
_PRIVATE_TORCH_ATTRIBUTES = {
    "_get_fsdp_state",
    "_fsdp_param_groups",
    "_fsdp_param_group",
    "_training_state",
    "_local_tensor",
    "_version",
    "_process_group",
    "_parameters",
    "_buffers",
    "_modules",
    "_apply",
    "_run_policy",
    "_module_classes_to_ignore",
    "_fqn_modifiers",
    *compat.MODULE_HOOK_DICTS,
}


def _torch_bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds to torch objects by import (``torch``, ``dist``, ``nn``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_torch_uses(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    torch_names = _torch_bound_names(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            private_names = [a.name for a in node.names if a.name.startswith("_")]
            if private_module or private_names:
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch.") and any(
                    part.startswith("_") for part in alias.name.split(".")
                ):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            dunder = node.attr.startswith("__") and node.attr.endswith("__")
            if dunder:
                continue
            if node.attr in _PRIVATE_TORCH_ATTRIBUTES or _root_name(node) in torch_names:
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in _PRIVATE_TORCH_ATTRIBUTES:
            found.append(f"{where}: {node.value!r}")
    return found


def test_no_module_reaches_a_private_torch_name_but_the_compat_module():
    offenders = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_torch_compat.py"
        for use in _private_torch_uses(path)
    ]
    assert not offenders, "private torch names outside _torch_compat.py:\n" + "\n".join(offenders)


def test_the_rule_finds_private_torch_names(tmp_path):
    """The scan above can fail: each kind of use it looks for is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp.wrap import _Policy\n"
        "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset\n"
        "import torch._dynamo\n"
        "dist.distributed_c10d._get_default_group()\n"
        "torch._foreach_norm([])\n"
        "def f(m, t):\n"
        "    return m._get_fsdp_state(), t._local_tensor, getattr(m, '_fqn_modifiers')\n"
        "class Mine:\n"
        "    def g(self):\n"
        "        return self._own, self.__dict__\n"
    )
    uses = {use.split(": ", 1)[1] for use in _private_torch_uses(sample, tmp_path)}
    assert uses == {
        "from torch.distributed.fsdp.wrap import ...",
        "from torch.distributed.tensor._utils import ...",
        "import torch._dynamo",
        "._get_default_group",
        "._foreach_norm",
        "._get_fsdp_state",
        "._local_tensor",
        "'_fqn_modifiers'",
    }


# ---------------------------------------------------------------------------- the range

REPO = PACKAGE.parent


def _torch_requirement() -> SpecifierSet:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [r for r in map(Requirement, declared) if r.name == "torch"]
    return torch_req.specifier


def test_the_admitted_torch_range_is_the_checked_one():
    """pyproject.toml admits from the lowest checked release to the newest checked minor."""
    checked = sorted(Version(v) for v in compat.CHECKED_ON)
    admitted = _torch_requirement()
    assert all(v in admitted for v in checked), f"{admitted} leaves out one of {checked}"
    lowest, newest = checked[0], checked[-1]
    below = Version(f"{lowest.major}.{lowest.minor}.{lowest.micro - 1}" if lowest.micro else "0")
    assert below not in admitted, f"{admitted} admits {below}, below the lowest checked {lowest}"
    above = Version(f"{newest.major}.{newest.minor + 1}.0")
    assert above not in admitted, f"{admitted} admits {above}, newer than any checked release"


def test_ci_runs_the_lowest_and_the_newest_checked_release():
    ci = (REPO / ".ci" / "run").read_text()
    lanes = re.search(r"for torch_version in ([\d. ]+); do\n\s+make test-torch ", ci)
    assert lanes, ".ci/run runs no make test-torch lanes"
    checked = sorted(compat.CHECKED_ON, key=Version)
    assert lanes.group(1).split() == [checked[0], checked[-1]]
