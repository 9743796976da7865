"""The trivial distributed script that torchrun relaunches in the dispatch and cold-start figures.

Every rank joins the process group (gloo, or the backend ``BENCH_BACKEND`` names, as any
FSDP script does first), waits at a barrier and runs the no-op body; rank 0 then prints ``READY <unix time>`` so the launcher can tell
when the group became usable.  The group is destroyed before exit.
"""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    backend = os.environ.get("BENCH_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"READY {time.time():.6f}", flush=True)
    pass  # the no-op cell body
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
