"""Two ranks beating as an engine's do (``distributed/heartbeat.py``, a beat a second), rank 0 hosting the
job's store (``run_ranks(..., store="rank0")``, ``init_method="env://"``), run by ``test_rank_faults.py``:
rank 0 ends its process normally at once; rank 1, still needing the others (armed, as at the tail of
``train()`` after its last collective), waits until its beat has found the store closed (the beat
thread ends), which must have read first that rank 0 left, then returns."""

from __future__ import annotations

import torch.distributed as dist

from elixir_runtime.distributed import heartbeat
from elixir_runtime.distributed.peer_failure import FailureBoard

dist.init_process_group("gloo")
heartbeat.start([0, 1], 10.0, FailureBoard("store_host"), None)
dist.barrier()  # both ranks beat
if dist.get_rank() == 1:
    with heartbeat.armed():
        heartbeat._beat.thread.join(60)
    assert not heartbeat._beat.thread.is_alive(), "the store did not close within 60 s"
    assert heartbeat._beat.seen[0][0] == heartbeat._LEFT, f"rank 0's last beat read: {heartbeat._beat.seen[0]}"
