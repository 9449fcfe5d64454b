"""The torchrun agent of `cnnkit train --nproc N` (`python -m cnnkit.agent TORCHRUN_ARGS`): a
Ctrl-C while it starts (torch takes seconds to import) ends it quietly, its parent saying so;
after that, torchrun passes a Ctrl-C on to the ranks, which agree on a step and save it."""

import signal
import sys

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from cnnkit.distributed import torchrun

    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(torchrun(sys.argv[1:]))
