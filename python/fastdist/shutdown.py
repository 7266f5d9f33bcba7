"""The exit: one atexit hook, one order, one time budget.

A thread of torch's or fastdist's that needs the GIL once the interpreter finalizes is killed
inside C++, and the process aborts ("terminate called without an active exception"). So before
Python finalizes, everything that may still call back into it is let finish, in this order:

- etcd lease keepalives stop (the lease then expires with its TTL), and RPC shutdowns that outlived
  their timeout are waited for once more (fastdist.rpc.shutdown), when those modules were used;
0. snapshot exchanges in flight (fastdist.PeerSnapshot's thread) count or fail: at most
   OPS_SECONDS;
1. the fault listener stops (it would otherwise answer a ring during finalization);
2. the engine runs the actions already due (a recovery agreement's closer whose deadline came
   with the exit): they hand store work to the closer thread, drained in step 6;
3. ops abandoned at their deadline end in the backend (gloo: at its own timeout, shortly after the
   deadline): at most OPS_SECONDS, none after Ctrl-C (the ops it ended
   wait for peers that never come, until the group's timeout, often minutes);
4. backend threads finish releasing ops that just completed (SETTLE_SECONDS): a waiter that woke
   on completion and exits at once can beat gloo's worker dropping the op's tensors;
5. NCCL aborts in progress end; dead groups' backends are kept, never
   destroyed (a destructor would join a thread still inside an op);
6. store calls given up on, or handed to the closer thread, return (the network may have come
   back): what is left of EXIT_SECONDS.
"""

from __future__ import annotations

import atexit
import sys
import time

from .deadlines import flush_engine
from .groups import abort
from .ops import fault, listener, watching, work
from .recovery import snapshot
from .store import bounded

# The whole exit's budget; the ops' drain gets at most OPS_SECONDS of it.
EXIT_SECONDS = 15.0
OPS_SECONDS = 2.0
FLUSH_SECONDS = 2.0
SETTLE_SECONDS = 0.05


@atexit.register
def _at_exit() -> None:
    start = time.monotonic()
    end = start + EXIT_SECONDS
    # By name, not imported: fastdist.rpc imports torch's RPC, which a job without it never loads.
    etcd, rpc = sys.modules.get("fastdist.store.etcd"), sys.modules.get("fastdist.rpc")
    if etcd is not None:
        etcd.stop_keepalives()
    if rpc is not None:
        rpc.join_lingering()
    snapshot.wait_all(0.0 if fault.interrupted() else OPS_SECONDS)
    if watching.active():
        listener.stop()
    flush_engine(FLUSH_SECONDS)
    ops_end = min(end, time.monotonic() + (0.0 if fault.interrupted() else OPS_SECONDS))
    watching.drain_inflight(ops_end)
    work.drain_abandoned(ops_end)
    time.sleep(SETTLE_SECONDS)
    abort.stop()
    if watching.active():
        watching.keep_dead_backends()
    bounded.drain(end)
