"""Kept for the modules that import ``CommonFields`` from here; the shared fields live in ``schemas.generation``."""

from trillm.api.schemas.generation import CommonFields

__all__ = ["CommonFields"]
