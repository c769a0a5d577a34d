"""A signal handler for the length of a block, put back after it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def handled(sig: signal.Signals, handler: Callable[..., Any] | int) -> Iterator[None]:
    """``handler`` (a function, ``SIG_IGN``) for ``sig`` within the block, then the one before.
    Nothing is changed where Python may not set it: outside the main thread (a caller may run
    us in another), or over a handler that C code installed (``getsignal`` gives None)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(sig) if main else None
    if before is not None:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        if before is not None:
            signal.signal(sig, before)
