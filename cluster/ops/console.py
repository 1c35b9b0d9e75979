"""A quiet console for ``rayrlhf train``: rayrlhf's own lines on the terminal, everything in a log.

A run's terminal would otherwise carry every library's chatter: deprecation warnings, Ray's
start-up banner, Ray Train's per-report lines, vLLM's and OpenMP's notices, forwarded from every
worker. ``Console`` replaces ``sys.stdout``/``sys.stderr`` with line filters: every line goes to
the run's log file (``<run dir>/train.log``; lines from before the run directory exists are
buffered), and only rayrlhf's own lines reach the terminal:

* ``[rayrlhf] ...`` messages and log records, also when Ray forwards them from a worker
  (``(GeneratorWorker pid=...) [rayrlhf] ...``);
* the progress line of each step (``[####----] step 3/20 | ...``);
* ``rayrlhf: ...`` errors.

``verbose=True`` keeps the terminal unfiltered (the log file is written all the same).
"""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import TextIO

LOG_FILE = "train.log"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's prefix on a line forwarded from a worker: "(ActorName pid=123)", "(pid=123, ip=...)".
_WORKER_PREFIX = re.compile(r"^\((?:[\w.:-]+ )?pid=[^)]*\)\s*")
_OWN = re.compile(r"^(\[rayrlhf\]|rayrlhf:|\[[#-]+\] step \d+/\d+)")


def is_own_line(line: str) -> bool:
    """Whether a console line is rayrlhf's own (kept on a quiet console)."""
    text = _WORKER_PREFIX.sub("", _ANSI.sub("", line).strip())
    return bool(_OWN.match(text))


class _LogFile:
    """The run's log: buffered in memory until ``open(path)``, then appended to the file."""

    def __init__(self) -> None:
        self._buffer: list[str] = []
        self._fh: TextIO | None = None
        self.path: Path | None = None

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("a", buffering=1)
        self.path = path
        self._fh.writelines(self._buffer)
        self._buffer = []

    def write(self, line: str) -> None:
        if self._fh is None:
            self._buffer.append(line)
        else:
            self._fh.write(line)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _FilteredStream(io.TextIOBase):
    """A text stream that splits what it is given into lines, logs every line and passes the
    kept ones to the real stream."""

    def __init__(self, real: TextIO, log: _LogFile, verbose: bool) -> None:
        self.real, self.log, self.verbose = real, log, verbose
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._partial += s
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._emit(line + "\n")
        return len(s)

    def _emit(self, line: str) -> None:
        self.log.write(_ANSI.sub("", line))
        if self.verbose or is_own_line(line):
            self.real.write(line)
            self.real.flush()

    def flush(self) -> None:
        self.real.flush()

    def fileno(self) -> int:  # subprocess and faulthandler want a real descriptor
        return self.real.fileno()

    def isatty(self) -> bool:
        return self.real.isatty()

    def finish(self) -> None:
        if self._partial:
            self._emit(self._partial + "\n")
            self._partial = ""


class Console:
    """Installs the filtered streams (``install``), points the log at the run directory once it
    exists (``attach``) and restores the terminal (``close``)."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.log = _LogFile()
        self._saved: tuple[TextIO, TextIO] | None = None

    def install(self) -> "Console":
        self._saved = (sys.stdout, sys.stderr)
        root = logging.getLogger()
        self._saved_logging = (root.handlers[:], root.level, warnings.filters[:])
        sys.stdout = _FilteredStream(sys.stdout, self.log, self.verbose)  # type: ignore[assignment]
        sys.stderr = _FilteredStream(sys.stderr, self.log, self.verbose)  # type: ignore[assignment]
        # Libraries that set up their own handlers before this (Ray's "ray" logger, for one)
        # hold the real streams: point those handlers at the filters too.
        swap = {id(self._saved[0]): sys.stdout, id(self._saved[1]): sys.stderr}
        self._moved: list[tuple[logging.StreamHandler, object]] = []
        loggers = [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)]
        for handler in {h for lg in loggers for h in getattr(lg, "handlers", [])}:
            if isinstance(handler, logging.StreamHandler) and id(getattr(handler, "stream", None)) in swap:
                self._moved.append((handler, handler.stream))
                handler.stream = swap[id(handler.stream)]
        # Library log records and Python warnings go through the root logger to the (filtered)
        # stderr: into the log file, not onto a quiet terminal.
        logging.captureWarnings(True)
        warnings.simplefilter("default")
        root.handlers = [logging.StreamHandler(sys.stderr)]
        root.handlers[0].setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.setLevel(logging.INFO)
        return self

    def attach(self, run_dir: Path) -> None:
        """Starts ``<run_dir>/train.log`` with what was printed so far."""
        if self.log.path is None:
            self.log.open(Path(run_dir) / LOG_FILE)

    @property
    def real_stderr(self) -> TextIO:
        return self._saved[1] if self._saved else sys.stderr

    def close(self) -> None:
        if self._saved is None:
            return
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, _FilteredStream):
                stream.finish()
        sys.stdout, sys.stderr = self._saved
        self._saved = None
        for handler, stream in self._moved:
            handler.stream = stream
        root = logging.getLogger()
        root.handlers, level, warnings.filters[:] = self._saved_logging
        root.setLevel(level)
        logging.captureWarnings(False)
        self.log.close()


# The console of the current ``rayrlhf train`` (None when a run is started from Python).
active: Console | None = None


def attach_run_dir(run_dir: Path) -> None:
    """Called by the run context once the run directory exists."""
    if active is not None:
        active.attach(run_dir)
