"""Who may use the server: API keys, checked in constant time, and never logged.

Keys come from ``--api-key`` (repeatable), ``--api-keys-file`` and ``TRILLM_API_KEY``; clients
send them as ``Authorization: Bearer KEY`` or (Anthropic's SDKs) ``x-api-key: KEY``.
Only their SHA-256 digests are kept: a presented key is hashed once and compared
with every digest by ``hmac.compare_digest``, all of them whatever matched, so
neither the time taken nor the path through the code says which key (or how
much of one) was right, and equal-length digests leak no key's length.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from pathlib import Path

import attrs

from trillm.api.errors import ApiError
from trillm.api.settings import ServerConfig

log = logging.getLogger("trillm.api")

# Open without a key whatever is configured: probes, discovery. ``/metrics`` joins them
# unless ``--metrics-require-key``; every other path (``/v1/*``, the admin routes, unknown
# URLs) needs a key, so a route added later is closed until it is listed here.
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@attrs.frozen
class ApiKeys:
    """The accepted keys, as digests (``repr`` shows only how many there are)."""

    digests: tuple[bytes, ...] = attrs.field(repr=lambda d: f"<{len(d)} keys>")
    metrics_require_key: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def needs_key(self, method: str, path: str) -> bool:
        """Whether a request must carry a key: CORS preflights (``OPTIONS``, which browsers send
        without credentials) and the open paths never do."""
        if not self.enabled or method == "OPTIONS" or path in OPEN_PATHS:
            return False
        return path != "/metrics" or self.metrics_require_key

    def check(self, authorization: str | None) -> int:
        """The index of the key an ``Authorization`` header carries; a 401 ``invalid_api_key`` otherwise."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        presented = _digest(token.strip())
        found = -1
        for index, digest in enumerate(self.digests):  # every key, no early exit
            if hmac.compare_digest(presented, digest):
                found = index
        if found < 0:
            raise unauthorized("Incorrect API key provided. Check the key you send in the Authorization header.")
        return found


def one_authorization(values: list[str]) -> str | None:
    """The request's one ``Authorization`` header; a 401 for several: a proxy that appends its own
    would otherwise be overruled by whichever came first (the client's, say)."""
    if len(values) > 1:
        raise unauthorized(
            f"The request has {len(values)} Authorization headers; send exactly one (Authorization: Bearer YOUR_KEY)."
        )
    return values[0] if values else None


def presented_key(authorization: list[str], x_api_key: list[str]) -> str | None:
    """The ``Authorization`` header to check: the request's own, else Anthropic's ``x-api-key``
    (its SDKs send the key there) as a bearer token. One of each at most, as ``one_authorization``."""
    if authorization or not x_api_key:
        return one_authorization(authorization)
    if len(x_api_key) > 1:
        raise unauthorized(f"The request has {len(x_api_key)} x-api-key headers; send exactly one.")
    return f"Bearer {x_api_key[0]}"


def unauthorized(message: str) -> ApiError:
    """OpenAI's 401 (the key itself is never echoed), with the challenge HTTP asks for."""
    return ApiError(
        message,
        401,
        code="invalid_api_key",
        type="invalid_request_error",
        headers={"WWW-Authenticate": "Bearer"},
    )


def load_keys(server: ServerConfig) -> ApiKeys:
    """Every configured key: the flags' and variable's, then the keys file's.

    A keys file that cannot be read, or that holds no key, stops the start-up
    (``SystemExit`` naming the file, never a key): failing open is worse.
    """
    keys = [k.strip() for k in server.api_key if k.strip()]
    if server.api_keys_file is not None:
        path = Path(server.api_keys_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"cannot read the API keys file {path}: {type(exc).__name__}") from None
        from_file = [line.split("#", 1)[0].strip() for line in lines]
        from_file = [k for k in from_file if k]
        if not from_file:
            raise SystemExit(f"the API keys file {path} holds no key")
        keys += from_file
    return ApiKeys(tuple(_digest(k) for k in dict.fromkeys(keys)), server.metrics_require_key)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable


def warn_if_open(keys: ApiKeys, server: ServerConfig) -> None:
    """Log a warning when anyone who can reach the port may use the server."""
    if not keys.enabled and not is_loopback(server.host):
        log.warning(
            "no API key is set and the server listens on %s: anyone who can reach it may use it "
            "(set --api-key, --api-keys-file or TRILLM_API_KEY)",
            server.host,
        )
    if not keys.enabled and server.max_concurrent_per_key is not None:
        log.warning("--max-concurrent-per-key has no effect without API keys")
