"""Run a script exported from a notebook session (argv[1]) as torchrun runs it, then save
what its ranks hold under the names argv[3] (the model) and argv[4] (the optimizer) to the
folder argv[2] (``save_state.py``), for a test to compare with the notebook's ranks."""

import os
import runpy
import sys

from save_state import save_state

names = runpy.run_path(sys.argv[1], run_name="__main__")
save_state(sys.argv[2], int(os.environ["RANK"]), names[sys.argv[3]], names[sys.argv[4]])
