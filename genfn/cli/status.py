"""Status lines on stderr: what the command is doing while it does it, then a summary.

Each phase (loading, kernel build, compiling) is announced when it starts and reported with its
elapsed time when it ends. On a terminal the phase is one line whose elapsed time ticks in place;
anywhere else (a pipe, a log file) it is two plain lines, so captured stderr never holds carriage
returns. A phase that begins while streamed text holds the terminal's line (a recompile in the
middle of decoding) ticks right after the text, inside brackets, and vanishes when it ends, so
the text reads on unbroken; stdout itself never receives a status character.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time

__all__ = ["Status", "format_seconds", "watch_compiles"]

_TICK_S = 0.5
_CLEAR_LINE = "\r\x1b[K"
_CLEAR_BELOW = "\x1b[J"  # from the cursor to the end of the screen
_SAVE_CURSOR, _RESTORE_CURSOR = "\x1b7", "\x1b8"


def _isatty(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


class Status:
    """Writes ``genfn: ...`` lines to the current ``sys.stderr`` (looked up per write, so tests
    that capture stderr see them). ``quiet`` drops the status lines but not those written with
    ``always=True`` (warnings, answers to chat commands); phases are timed either way. ``live``
    (default: stderr is a terminal) turns on the in-place ticker. ``silent``: not even those (a
    tensor-parallel rank other than 0, whose lines rank 0 writes)."""

    def __init__(self, quiet: bool = False, live: bool | None = None, silent: bool = False):
        self.quiet = quiet or silent
        self.silent = silent
        self._live = live
        self._lock = threading.RLock()
        self._phase: tuple[str, float, bool] | None = None  # (text, start, after streamed text?)
        self._ticker: threading.Thread | None = None
        self._drawn: str | bool = False  # "line" / "inline": a live phase is on screen, no newline after it
        self.text_open = False  # stdout holds streamed text whose line is not finished

    @property
    def live(self) -> bool:
        if self._live is not None:
            return self._live
        return _isatty(sys.stderr)

    def line(self, text: str, always: bool = False) -> None:
        """One status line (a live phase line on screen is redrawn after it); ``always`` shows it
        under ``quiet`` too (warnings)."""
        if (self.quiet and not always) or self.silent:
            return
        with self._lock:
            self._erase()
            _raw_stderr().write(f"genfn: {text}\n")
            _raw_stderr().flush()
            self._draw()

    def begin(self, text: str) -> None:
        with self._lock:
            self._erase()
            inline = self.text_open and self.live and _isatty(sys.stdout)
            self._phase = (text, time.perf_counter(), inline)
            if self.quiet:
                return  # timed all the same: the caller may report the seconds
            if self.live:
                self._draw()
                if self._ticker is None or not self._ticker.is_alive():
                    self._ticker = threading.Thread(target=self._tick, name="genfn-status", daemon=True)
                    self._ticker.start()
            else:
                _raw_stderr().write(f"genfn: {text}...\n")
                _raw_stderr().flush()

    def end(self, done: str | None = None) -> float:
        """Close the current phase: ``done`` (default ``<phase text>: done``) with the elapsed time;
        returns the elapsed seconds. A phase shown after streamed text on the terminal just
        vanishes, leaving the text as it was (the summary reports its time)."""
        with self._lock:
            if self._phase is None:
                return 0.0
            text, start, inline = self._phase
            elapsed = time.perf_counter() - start
            self._erase()
            self._phase = None
            if not self.quiet and not inline:
                _raw_stderr().write(f"genfn: {done or text + ': done'} ({format_seconds(elapsed)})\n")
                _raw_stderr().flush()
            return elapsed

    @contextlib.contextmanager
    def phase(self, text: str, done: str | None = None):
        self.begin(text)
        try:
            yield
        except BaseException:
            with self._lock:
                self._erase()
                self._phase = None
            raise
        self.end(done)

    def close(self) -> None:
        with self._lock:
            self._erase()
            self._phase = None
            if isinstance(sys.stderr, _ClearingStderr) and sys.stderr.status is self:
                sys.stderr = sys.stderr.stream

    # ---- the live line -----------------------------------------------------------------------

    def _erase(self) -> None:
        if self._drawn:
            # Inline, the ticker sits after the text's cursor: clear from there to the end of the screen.
            _raw_stderr().write(_CLEAR_BELOW if self._drawn == "inline" else _CLEAR_LINE)
            _raw_stderr().flush()
            self._drawn = False

    def _draw(self) -> None:
        if self._phase is None or not self.live or self.quiet:
            return
        text, start, inline = self._phase
        stream = _raw_stderr()
        ticker = f"... {time.perf_counter() - start:.0f} s"
        if inline:
            # Streamed text holds the line: draw after its last character and put the cursor back
            # there (save/restore cursor), so the text goes on where it stopped once this clears.
            stream.write(f"{_CLEAR_BELOW}{_SAVE_CURSOR} [genfn: {text}{ticker}]{_RESTORE_CURSOR}")
            stream.flush()
            self._drawn = "inline"
        else:
            # A line wider than the terminal wraps, and the carriage return would then redraw only
            # its last row: keep it one row.
            line = f"genfn: {text}"
            room = shutil.get_terminal_size((80, 24)).columns - 1 - len(ticker)
            if len(line) > room:
                line = line[:max(room - 1, 0)] + "…"
            stream.write(f"{_CLEAR_LINE}{line}{ticker}")
            stream.flush()
            self._drawn = "line"
        if not isinstance(sys.stderr, _ClearingStderr):
            # Others' writes (a library's print, a warning) first clear the ticking line.
            sys.stderr = _ClearingStderr(sys.stderr, self)

    def _tick(self) -> None:
        shown = None
        while True:
            time.sleep(_TICK_S)
            with self._lock:
                if self._phase is None:
                    return
                second = int(time.perf_counter() - self._phase[1])
                if second != shown or not self._drawn:  # redraw when the count changes or the line was cleared
                    shown = second
                    self._draw()


class _ClearingStderr:
    """sys.stderr while a live line ticks: a write from anyone else erases the line first (the
    ticker draws it again on its next tick)."""

    def __init__(self, stream, status: Status):
        self.stream, self.status = stream, status

    def write(self, text: str) -> int:
        with self.status._lock:
            self.status._erase()
            return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _raw_stderr():
    stream = sys.stderr
    return stream.stream if isinstance(stream, _ClearingStderr) else stream


@contextlib.contextmanager
def watch_compiles(status: Status, what: str = "compiling the decode step (torch.compile)", compiles: bool = True):
    """Show each torch.compile run (dynamo's compile start/end callbacks, on whichever thread
    compiles) as a status phase; yields a list that collects each compile's seconds.
    ``compiles=False`` (a run that stays eager) watches nothing: registering the callbacks imports
    dynamo, seconds of an eager command's start."""
    seconds: list[float] = []
    if not compiles:
        yield seconds
        return
    from torch._dynamo import callback as dynamo_callback

    def started(_args) -> None:
        status.begin(what)

    def ended(_args) -> None:
        seconds.append(status.end("compiled the decode step"))

    handler = dynamo_callback.callback_handler
    handler.register_start_callback(started)
    handler.register_end_callback(ended)
    try:
        yield seconds
    finally:
        handler.remove_start_callback(started)
        handler.remove_end_callback(ended)
