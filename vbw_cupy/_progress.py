"""Progress for slow first calls: a tqdm bar (plain lines where tqdm is missing) that appears only when the work
takes longer than AFTER_S, and a one-line notice on stderr for a single slow step (compiling, tuning)."""
from __future__ import annotations

import contextlib
import sys
import threading
import time

#: seconds of silence before a bar or a notice appears
AFTER_S = 2.0

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - depends on the environment
    _tqdm = None


def bar(iterable, total: int, desc: str, after: float | None = None):
    """`iterable`, with a progress bar on stderr once `after` seconds have passed: tqdm's, or without tqdm a
    line '<desc>: i/total' at most once a second. `after` defaults to AFTER_S."""
    after = AFTER_S if after is None else after
    if _tqdm is not None:
        yield from _tqdm(iterable, total=total, desc=desc, delay=after, file=sys.stderr, unit="kernel")
        return
    t0 = last = time.perf_counter()
    for i, item in enumerate(iterable, 1):
        yield item
        now = time.perf_counter()
        if now - t0 > after and (now - last >= 1.0 or i == total):
            last = now
            print(f"{desc}: {i}/{total} ({now - t0:.0f} s)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def notice(what: str, after: float | None = None):
    """Around a step that is usually quick: when it runs past `after` seconds, print 'vbw_cupy: <what> ...' on
    stderr then, and 'done in X s' at its end; quick steps print nothing. `after` defaults to AFTER_S."""
    after = AFTER_S if after is None else after
    t0 = time.perf_counter()
    shown = threading.Event()

    def show():
        shown.set()
        print(f"vbw_cupy: {what} ...", file=sys.stderr, flush=True)

    timer = threading.Timer(after, show)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"vbw_cupy: {what}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
