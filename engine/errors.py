"""Why the engine refuses a request. The HTTP layer maps each to a status code in one place."""

from __future__ import annotations


class RequestRejected(ValueError):
    """The request can never be served (e.g. its prompt does not fit the context).

    ``param`` names the part of the request at fault, ``code`` a stable reason.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineNotRunning(RuntimeError):
    """Raised by ``submit`` when the engine is not (or no longer) taking work."""


class EngineOverloaded(RuntimeError):
    """Raised by ``submit`` when the waiting queue is full; try again shortly."""
