"""Graceful stop on SIGINT / SIGTERM: finish the step in progress, save it, then stop."""
from __future__ import annotations

import sys


class GracefulInterrupt:
    """While a run with a checkpoint directory trains, the first SIGINT (Ctrl-C) or SIGTERM (`kill PID`, a
    supervisor's stop, `docker stop`, a scheduler's preemption) asks it to stop after the step in progress and save a
    checkpoint (a step cut half way, e.g. inside the optimizer update, could not be saved as any step); a second one
    stops at once. A distributed run agrees on the request over all ranks after every step (`Loop.fit`), so
    every rank stops and saves at the same step. A caller outside the main thread keeps the default, and so does
    a signal that someone else already handles. SIGHUP keeps its default: after a hang-up the terminal the progress
    bar writes to is gone."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, enabled: bool, announce: bool = True):
        import signal
        import threading

        self.requested = False
        self.announce = announce
        self._previous: dict = {}
        if not enabled or threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            untouched = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            if signal.getsignal(sig) is untouched:  # someone else handles it (or ignores it): leave it to them
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        import signal

        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.announce:
            try:
                print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint; press Ctrl-C again (or send "
                      "the signal again) to stop at once", file=sys.stderr, flush=True)
            except OSError:  # no terminal to tell any more: the save matters more
                pass

    def restore(self) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
