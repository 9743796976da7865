"""The distributed script whose rank the death-detection figure kills under torchrun.

Every rank joins the gloo process group, waits at a barrier, prints
``READY <rank> <pid>`` and then sleeps (as a rank busy in a long cell would), until the
launcher ends it.
"""

import os
import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    # One write per line: the ranks share torchrun's stdout, and print() writes the text
    # and its newline separately, so two ranks' lines could interleave.
    os.write(1, f"READY {dist.get_rank()} {os.getpid()}\n".encode())
    time.sleep(600)


if __name__ == "__main__":
    main()
