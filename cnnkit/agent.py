"""The torchrun agent of `cnnkit train --nproc N` (`python -m cnnkit.agent TORCHRUN_ARGS`), in a
session of its own: its parent passes each SIGINT and SIGTERM on to it. A Ctrl-C while it starts
(torch takes seconds to import) ends it quietly, its parent saying so; after that, torchrun
passes a Ctrl-C on to the ranks, which agree on a step and save it. It ends with its parent
(SIGTERM), should the parent be killed outright."""

import os
import signal
import sys


def end_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux; elsewhere nothing); exit now if
    the parent is gone already."""
    parent = int(os.environ.get("CNNKIT_PARENT", "0"))
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):
        return
    if parent and os.getppid() != parent:
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    end_with_parent()
    from cnnkit.distributed import torchrun

    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(torchrun(sys.argv[1:]))
