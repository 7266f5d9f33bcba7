"""One process per pytest worker that has imported torch once, and forks each rank of
tests/support/mp.py's ``run_ranks`` from there: ``import torch`` costs each new interpreter about 1.6 s of
CPU on this 2-core machine, and the suite starts a few hundred ranks.

What a rank gets is a fresh process as far as the test can tell: its own environment, working
directory, argv, stdout and stderr, default signal handlers, nothing of fastdist imported (its
settings are read at import, from the rank's environment), and a normal interpreter exit (threads
joined, atexit hooks run, modules torn down: the exit tests measure that). Only torch's import is
shared. ``FASTDIST_TEST_SPAWN=exec`` makes run_ranks start each rank as its own interpreter
instead.

The protocol, on one Unix socket pair (``python -u zygote.py FD``): a request is one message
with a JSON body ``{"argv", "env", "cwd"}`` and two file descriptors (stdout, stderr); each answer
is one JSON line: ``{"ready"}`` once, ``{"pid"}`` per request, ``{"exit", "code"}`` per rank that
ended (``code`` as ``Popen.returncode`` says it: minus the signal's number when a signal ended
it). The zygote ends with its socket's other end (or with its parent: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from typing import Any


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _send(sock: socket.socket, **msg: Any) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def serve(fd: int) -> tuple[dict[str, Any], int, int] | None:
    """Serves requests until the socket closes (returns None), or, in a forked child, returns
    what the child runs: (the request, its stdout, its stderr)."""
    sock = socket.socket(fileno=fd)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, None)
    _send(sock, ready=True)
    while True:
        for key, _ in sel.select():
            if key.data is None:  # a request, or the end
                try:
                    body, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 2)
                except OSError:
                    return None
                if not body:
                    return None
                request = json.loads(body)
                pid = os.fork()
                if pid == 0:  # the rank: none of the zygote's descriptors
                    for other in list(sel.get_map().values()):
                        if other.data is not None:
                            os.close(other.fd)  # (its siblings' pidfds)
                    sel.close()
                    sock.close()
                    return request, fds[0], fds[1]
                for f in fds:
                    os.close(f)
                pidfd = os.pidfd_open(pid)
                sel.register(pidfd, selectors.EVENT_READ, pid)
                _send(sock, pid=pid)
            else:  # a rank ended
                pid = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, exit=pid, code=os.waitstatus_to_exitcode(status))


def run_child(request: dict[str, Any], out: int, err: int) -> None:
    """In the forked child: becomes the rank's process, then runs its script as ``__main__``."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (as Python's own start-up leaves it)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][1]
    sys.argv = request["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _die_with_parent()
    import torch  # (what every rank would import: once, here)
    import torch.distributed  # noqa: F401

    child = serve(int(sys.argv[1]))
    if child is not None:
        run_child(*child)
