"""Each pytest-xdist worker's share of the cores, set before anything imports torch.

``make test`` runs one worker per core: each worker's forward passes, and the servers it
starts (they read TRILLM_NUM_THREADS), take that worker's share, so no two OpenMP teams
spin for one core. Imported first by ``conftest.py``; a run without xdist is untouched."""

import os

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    share = str(max(1, (os.cpu_count() or 1) // WORKERS))
    os.environ.setdefault("TRILLM_NUM_THREADS", share)
    os.environ.setdefault("OMP_NUM_THREADS", share)
