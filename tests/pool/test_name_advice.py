"""A rank's NameError for a name the kernel has says to push it (API words here; the
magic's words in tests/notebook/test_magics.py), on the shared real 2-rank pool."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import Pool, RankError
from fsdp_interactive.pool._name_advice import caller_namespace


def test_a_name_the_kernel_has_but_the_ranks_lack_is_pushed_with_pool_push(pool: Pool):
    namespace = caller_namespace()
    namespace["lr_of_the_kernel"] = 0.1
    try:
        with pytest.raises(RankError) as info:
            pool.run("step = lr_of_the_kernel * 2\nprint(also_missing)", stream=False)
    finally:
        del namespace["lr_of_the_kernel"]
    error = info.value
    assert error.ranks == [0, 1]
    message = str(error)
    assert (
        "Send the kernel's lr_of_the_kernel to the ranks with "
        "pool.push({'lr_of_the_kernel': lr_of_the_kernel}), or look at the failing frame "
        "with pool.debug(0, 'p NAME')." in message
    )
    assert "%fsdp push lr_of_the_kernel" in error.notebook_message()
    pool.push({"lr_of_the_kernel": 0.1})  # what it says works: the cell then runs
    pool.run("step = lr_of_the_kernel * 2", stream=False)
    assert pool.pull("step") == [0.2, 0.2]


def test_a_name_nobody_has_gets_no_push_advice(pool: Pool):
    with pytest.raises(RankError) as info:
        pool.run("print(defined_nowhere_at_all)", stream=False)
    assert "push" not in str(info.value) and "push" not in info.value.notebook_message()
