"""`python -m k3.parallel.torchrun ARGS` is torchrun (`python -m torch.distributed.run ARGS`), except when a signal
stops it: torchrun's agent turns SIGINT, SIGTERM, SIGHUP or SIGQUIT into a SignalException, shuts the ranks down
with the same signal and lets the exception end the process with a traceback, which read like a crash after a
plain Ctrl-C. Here it ends with exit status 128 + the signal and one line instead; every other outcome (the ranks'
exit codes, torchrun's report of a failed rank) is torchrun's own. `k3 train --nproc N` launches this."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        import signal

        sig = int(e.sigval)
        print(f"torchrun: stopped by {signal.Signals(sig).name}", file=sys.stderr)
        return 128 + sig
    return 0


if __name__ == "__main__":
    sys.exit(main())
