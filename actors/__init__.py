"""The roles as plain classes (usable without Ray): ``rollout`` (the generator over vLLM),
``agents`` (episodes, environments, tools, the agent endpoint), ``rewards`` (scorers, reward
models, the judge), ``data`` (tasks, tables, offline data, replay) and the ``reference``.

rayrlhf's own log records (loggers under ``rayrlhf``) are written as ``[rayrlhf] LEVEL name:
message`` wherever these classes run, so a console that keeps only rayrlhf's lines (see
``cluster/ops/console.py``) keeps them, also when Ray forwards them from a worker.
"""

import logging
import sys


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (the driver replaces it with
    its console filter after this module is imported)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_root = logging.getLogger("rayrlhf")
if not _root.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(logging.Formatter("[rayrlhf] %(levelname)s %(name)s: %(message)s"))
    _root.addHandler(_handler)
    _root.propagate = False
    _root.setLevel(logging.INFO)
