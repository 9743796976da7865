"""``python -m fsdp_interactive.cli``: the same as the ``fsdp-interactive`` command."""

import sys

from fsdp_interactive.cli import main

sys.exit(main())
