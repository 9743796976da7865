"""The trivial distributed script of ``noop_rank.py``, after the imports of an FSDP script.

A training script with FSDP imports torch's FSDP (and with it DTensor) before it joins
the process group; a pool's ranks have those modules imported when ``Pool.start()``
returns. The cold-start figure relaunches this script as the like-for-like reference.
"""

import torch.distributed.fsdp  # noqa: F401  (what an FSDP script imports first)
from noop_rank import main

if __name__ == "__main__":
    main()
