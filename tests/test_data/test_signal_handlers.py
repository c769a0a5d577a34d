"""A handler for a block: set in it, the one before put back after, untouched off the main
thread (where Python may not set one)."""

from __future__ import annotations

import signal
import threading

from data.signal_handlers import handled


def test_a_handler_holds_for_the_block_and_the_one_before_comes_back():
    before = signal.getsignal(signal.SIGUSR2)
    with handled(signal.SIGUSR2, signal.SIG_IGN):
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGUSR2) == before
    seen = []

    def elsewhere() -> None:
        with handled(signal.SIGUSR2, signal.SIG_IGN):  # no ValueError: nothing is set here
            seen.append(signal.getsignal(signal.SIGUSR2))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [before]
