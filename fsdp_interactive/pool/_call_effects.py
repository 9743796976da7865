"""What a call, an assignment or a loop in a cell changes, told by names alone (kernel side,
for :mod:`._cell_effects`): which methods and functions change a module or optimizer in a
way no ``state_dict`` holds (*reshaping*), which calls on a module change the process
(*settings*), and which names are parts of another name's object (``model.layers[0]``).

The lists are what torch, transformers and the standard library call these things; a name
not listed is a use, or, for a call whose result is dropped, a change that a snapshot's
``state_dict`` holds (``optim.step()``).
"""

from __future__ import annotations

import ast

#: Methods that change a module or optimizer in a way its ``state_dict`` does not hold
#: (besides every ``register_*``).
RESHAPING_METHODS = frozenset(
    {
        "add_module",
        "add_param_group",
        "apply",
        "bfloat16",
        "compile",
        "cpu",
        "cuda",
        "double",
        "float",
        "half",
        "requires_grad_",
        "set_submodule",
        "share_memory",
        "to",
        "to_empty",
        "type",
        "xpu",
    }
)
#: Functions that change the module given as their first argument in place.
RESHAPING_FUNCTIONS = frozenset(
    {
        "apply_activation_checkpointing",
        "delattr",
        "fully_shard",
        "register_parametrization",
        "remove_parametrizations",
        "remove_spectral_norm",
        "remove_weight_norm",
        "replicate",
        "setattr",
        "spectral_norm",
        "weight_norm",
    }
)
#: Calls on an imported module that change the process (besides every ``set_*``,
#: ``enable_*`` and ``disable_*``).
SETTING_CALLS = frozenset(
    {
        "add_dll_directory",
        "add_safe_globals",
        "basicConfig",
        "chdir",
        "filterwarnings",
        "putenv",
        "setLevel",
        "simplefilter",
        "use_deterministic_algorithms",
    }
)
#: Seeding calls: not settings, the journal keeps each cell's generators.
SEEDING = frozenset({"manual_seed", "manual_seed_all", "seed", "set_seed", "set_rng_state"})
#: Module attributes that are process state mutated in place (``sys.path.append``).
PROCESS_CONTAINERS = frozenset({"path", "environ", "modules", "meta_path", "argv"})
CONTAINER_METHODS = frozenset(
    {"append", "extend", "insert", "update", "setdefault", "pop", "remove", "clear"}
)
#: Calls whose dropped result does not mean they changed their arguments.
PURE_STATEMENT_CALLS = frozenset({"print", "display", "len", "repr", "str", "type", "id"})


def root_of(node: ast.AST) -> ast.Name | None:
    """The name at the start of ``a.b[c].d`` (``None`` for anything else)."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def dotted_name(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain (subscripts as ``[...]``), ``?`` elsewhere."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return f"{dotted_name(node.value)}[...]"
    if isinstance(node, ast.Call):
        return f"{dotted_name(node.func)}(...)"
    return "?"


#: Methods and functions whose result is part of the object they are called on or given:
#: ``for p in model.parameters(): p.requires_grad = False`` changes ``model``.
VIEWING_METHODS = frozenset(
    {
        "buffers",
        "children",
        "get_parameter",
        "get_submodule",
        "modules",
        "named_buffers",
        "named_children",
        "named_modules",
        "named_parameters",
        "parameters",
        "values",
        "items",
    }
)
WRAPPING_CALLS = frozenset({"enumerate", "zip", "list", "tuple", "reversed", "sorted", "iter"})


def part_of(value: ast.AST | None) -> ast.Name | None:
    """The name whose object ``value`` is (``model``) or is a part of (``model.layers[0]``,
    ``model.parameters()``, ``enumerate(model.blocks)``), or ``None``."""
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Name) and func.id in WRAPPING_CALLS and value.args:
            return part_of(value.args[0])
        if isinstance(func, ast.Attribute) and func.attr in VIEWING_METHODS:
            return part_of(func.value)
        return None
    if isinstance(value, ast.Name | ast.Attribute | ast.Subscript):
        return root_of(value)
    return None


def is_setting(func: ast.Attribute, name: str) -> bool:
    if name in SEEDING:
        return False
    if name.startswith(("set_", "enable_", "disable_")) or name in SETTING_CALLS:
        return True
    owner = func.value
    return (
        isinstance(owner, ast.Attribute)
        and owner.attr in PROCESS_CONTAINERS
        and name in CONTAINER_METHODS
    )
