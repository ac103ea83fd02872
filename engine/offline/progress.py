"""``generate``'s progress bar: tqdm's, on a terminal only (a log file or a pipe gets none)."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

from trillm.engine.offline.results import RequestOutput


class Progress:
    """Prompts finished, and the output tokens per second so far."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._tokens = 0
        self._started = time.monotonic()
        if not (enabled and total and sys.stderr.isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:  # no bar without tqdm; nothing else changes
            return
        self._bar = tqdm(total=total, desc="Processed prompts", unit="prompt", file=sys.stderr, dynamic_ncols=True)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def finished(self, out: RequestOutput) -> None:
        if self._bar is None:
            return
        self._tokens += sum(len(o.token_ids) for o in out.outputs)
        rate = self._tokens / max(time.monotonic() - self._started, 1e-9)
        self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self._bar.update(1)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()
