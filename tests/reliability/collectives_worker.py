"""Run on 2 ranks by ``test_clean_exit.py``: the engine's collectives on tensors made in
Python, then a plain return, the rank's last act a collective (as rank 1's after a final save's
gather). Before the fix, 6 in 30 such runs of bare torch collectives aborted at exit."""

import torch
import torch.distributed as dist

from elixir_runtime.distributed.collectives import Collectives

dist.init_process_group("gloo")
coll = Collectives(None)
for _ in range(50):
    full = torch.ones(1 << 16)
    coll.all_gather_(full)
    coll.reduce_scatter_avg_(full)
