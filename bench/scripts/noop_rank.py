"""The trivial distributed script that torchrun relaunches in the dispatch and cold-start figures.

Every rank joins the gloo process group (as any FSDP script does first), waits at a barrier
and runs the no-op body; rank 0 then prints ``READY <unix time>`` so the launcher can tell
when the group became usable.  The group is destroyed before exit.
"""

import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"READY {time.time():.6f}", flush=True)
    pass  # the no-op cell body
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
