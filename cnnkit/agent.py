"""The torchrun agent of `cnnkit train --nproc N` (`python -m cnnkit.agent TORCHRUN_ARGS`, started
by start_local), in a session of its own: its parent passes each SIGINT and SIGTERM on to it. A Ctrl-C while it starts
(torch takes seconds to import) ends it quietly, its parent saying so; after that, torchrun
passes a Ctrl-C on to the ranks, which agree on a step and save it. It ends with its parent
(SIGTERM), should the parent be killed outright."""

import os
import signal
import subprocess
import sys
from typing import Any


def start_local(nproc: int, argv: list[str], max_restarts: int = 0,
                run_dir: str = "RUN_DIR") -> int:  # fmt: skip
    """`cnnkit train --nproc N ...`: run torchrun for one machine; returns its exit status
    (`run_dir`: where the run writes, named by the hint after a second Ctrl-C)."""
    cmd = [
        sys.executable, "-m", "cnnkit.agent", "--standalone",
        f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", "-m", "cnnkit", *argv,
    ]  # fmt: skip
    env = dict(os.environ, CNNKIT_NPROC=str(nproc), CNNKIT_PARENT=str(os.getpid()))
    # the cores shared among the processes (torchrun would set 1 and print a banner about it)
    from cnnkit.runtime import available_cores  # (here, not at the top: the agent starts light)

    env.setdefault("OMP_NUM_THREADS", str(max(1, available_cores() // nproc)))
    # The agent runs in a session of its own and gets each SIGINT and SIGTERM from this process,
    # whether a terminal's Ctrl-C (the foreground group: this process alone now) or a `kill` of
    # this pid (a scheduler's): one signal either way. torchrun's agent passes it on to the
    # ranks: at SIGINT they agree on a step, save and stop; at SIGTERM they end. The agent also
    # ends with this process (cnnkit.agent), should it be killed outright.
    # (SIGINT ignored from before the start, which the agent inherits until cnnkit.agent's
    # first line: a Ctrl-C inside Python's own start-up would be a traceback)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.getsignal(signal.SIGTERM)}  # fmt: skip
    try:
        agent = subprocess.Popen(cmd, env=env, start_new_session=True)

        interrupts = []

        def forward(signum: int, frame: object) -> None:
            interrupts.extend([signum] if signum == signal.SIGINT else [])
            agent.send_signal(signum)

        for s, handler in previous.items():
            if handler is not signal.SIG_IGN:  # a background job's SIGINT stays ignored
                signal.signal(s, forward)
        code = agent.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code == -signal.SIGINT:  # Ctrl-C while the agent started: no rank ran yet
        print("cnnkit: interrupted", file=sys.stderr)
    elif code == 130 and len(interrupts) > 1:  # a second Ctrl-C ends the ranks before they speak
        print("cnnkit: interrupted again: the processes stopped at once (`cnnkit train --resume "
              f"{run_dir} --nproc {nproc}` continues from the last checkpoint saved)",
              file=sys.stderr)  # fmt: skip
    elif code in (-signal.SIGTERM, 128 + signal.SIGTERM):  # the ranks end without a word
        print("cnnkit: terminated (SIGTERM)", file=sys.stderr)
    elif code < 0:  # the agent killed outright (the OOM killer's SIGKILL): its ranks end with it
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal: its number
            name = f"signal {-code}"
        print(f"cnnkit: error: torchrun's agent was killed by {name}; its processes ended with it",
              file=sys.stderr)  # fmt: skip
    return 128 - code if code < 0 else code  # a signal's number, as a shell reports it


def end_with_parent(parent: int = 0) -> None:
    """SIGTERM to this process when its parent dies (Linux; elsewhere nothing); exit now if
    the parent (`parent`'s pid where known) is gone already. The agent calls it, and so does
    each rank of --nproc (a killed agent would leave them training on, orphaned)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, TypeError):
        return
    if (parent and os.getppid() != parent) or os.getppid() == 1:
        sys.exit(128 + signal.SIGTERM)


def torchrun(args: list[str]) -> int:
    """torchrun's main (start_local's agent) with its failure report cut down to cnnkit's: the
    ranks have printed their one error line, so no table of failures and no traceback; the
    exit status is the first failed rank's (2 for a configuration error), a rank killed by a
    signal is one line."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):  # (each has a level of its own)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    _ranks_start_with_interrupts_held()
    try:
        main(args)
    except SignalException as e:  # SIGINT: the ranks have said where they stood; SIGTERM
        return 128 + e.sigval
    except KeyboardInterrupt:
        return 130
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        print(f"cnnkit: error: rank {rank} was killed by {failure.signal_name()}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _ranks_start_with_interrupts_held() -> None:
    """Start each rank with SIGINT blocked: a Ctrl-C passed on while a rank's Python starts
    (its site import, cnnkit's import) waits, pending, until cnnkit's main unblocks it and
    says "interrupted" in one line, instead of two tracebacks and "Fatal Python error". The
    mask is inherited through fork and exec. Where this torch spawns its ranks otherwise (a
    private method), they start as torch starts them."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as handler,
        )

        popen = handler.SubprocessHandler._popen
    except (ImportError, AttributeError):
        return
    if not hasattr(signal, "pthread_sigmask"):  # (Windows)
        return

    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return popen(self, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (a Ctrl-C held meanwhile comes)

    handler.SubprocessHandler._popen = held


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C while torch imports: a quiet end
    end_with_parent(int(os.environ.get("CNNKIT_PARENT", "0")))
    import torch.distributed.run  # noqa: F401 (seconds; torchrun's own import is then free)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(torchrun(sys.argv[1:]))
