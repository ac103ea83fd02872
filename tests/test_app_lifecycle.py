"""A stopped app gives its engine back to the collector.

Regression: the app freezes the heap at start (``gc.freeze``, so full collections skip the
long-lived objects) and unfroze it only after ``host.stop()`` returned; a stop that was
cancelled (as at every shutdown of the test servers) skipped ``gc.unfreeze``, and the
engine, with its KV pool, could never be collected: +180 MiB per server in one process,
which ran the test suite out of its 24 GiB.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.server import running_server

pytestmark = [pytest.mark.e2e]


async def test_a_stopped_server_lets_its_engine_be_collected(model_parts):
    async with running_server(model_parts) as srv:
        engine = weakref.ref(srv.engine)
        assert gc.get_freeze_count() > 0  # frozen while it serves
    del srv
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine() is None, "the engine of a stopped server is still alive"
