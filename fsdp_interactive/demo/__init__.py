"""The ``fsdp-interactive demo`` job: train a tiny transformer with FullyShardedDataParallel.

Notebook side (:mod:`._driver`) drives a :class:`pool.Pool`; the work
runs on the ranks (:mod:`._rank_job`); :mod:`._report` draws the PNG report of the
:class:`DemoResult` (:mod:`._result`) the driver fills.
"""

from fsdp_interactive.demo._demo_config import DemoConfig
from fsdp_interactive.demo._driver import run_demo
from fsdp_interactive.demo._result import DemoResult

__all__ = ["DemoConfig", "DemoResult", "run_demo"]
