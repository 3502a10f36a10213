"""Does a plain gloo process group survive ``torchrun --max-restarts``? The reproduction behind docs/recovery.md.

    torchrun --standalone --nproc-per-node=3 --max-restarts=1 benchmarks/gloo_restart.py             # fails
    torchrun --standalone --nproc-per-node=3 --max-restarts=1 benchmarks/gloo_restart.py --prefixed  # exits 0

Every process forms the default gloo group and all-reduces five times; in the first incarnation rank 1 SIGKILLs
itself at the third. torchrun then restarts all three. Plainly formed, the new group reads the killed incarnation's
addresses from torchrun's store and fails (``Gloo connectFullMesh failed ... Connection refused``); with
``--prefixed`` every incarnation meets under a store prefix of its own (what ``runtime="distributed"`` does).
"""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if "--prefixed" in sys.argv:
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=60)))
    store = dist.PrefixStore(f"restart_{attempt}/", store)  # fresh keys for every incarnation
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"attempt {attempt} rank {rank}: group formed", flush=True)
t = torch.ones(1)
for step in range(5):
    if attempt == 0 and rank == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
print(f"attempt {attempt} rank {rank}: done, sum {t.item()}", flush=True)
dist.destroy_process_group()
