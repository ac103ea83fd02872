"""Other OpenAI-compatible servers measured beside trillm in one ``trillm bench`` run.

``--peer NAME=URL[,pid=PID]`` names a server already running (llama.cpp's ``llama-server``,
vLLM, another trillm): the bench drives it with the same prompts, output length and client
counts as trillm's own runs, and reads its resident memory from ``/proc/PID`` when given.
"""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class Peer:
    name: str
    url: str
    pid: int | None = None


def parse_peer(text: str) -> Peer:
    """``NAME=URL`` or ``NAME=URL,pid=PID``; ValueError (one line) for anything else."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--peer takes NAME=URL[,pid=PID], not {text!r}")
    url, _, options = rest.partition(",")
    pid = None
    if options:
        key, _, value = options.partition("=")
        if key != "pid" or not value.isdigit():
            raise ValueError(f"--peer options are pid=PID, not {options!r}")
        pid = int(value)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer's URL must start with http:// or https://, not {url!r}")
    return Peer(name, url.rstrip("/"), pid)


def served_model(url: str, fallback: str) -> str:
    """The first model the server lists at ``/v1/models`` (what its requests must name)."""
    import httpx

    try:
        data = httpx.get(url + "/v1/models", timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return fallback
    return str(data[0]["id"]) if data else fallback


def resident_mib(pid: int | None) -> float | None:
    """VmRSS of a process and every process under it, in MiB (None when unknown or gone): vLLM's
    engine runs in a child of the API server's process, and its memory counts too."""
    if pid is None:
        return None
    own = _rss_kb(pid)
    if own is None:
        return None
    return (own + sum(_rss_kb(child) or 0 for child in _descendants(pid))) / 1024


def _rss_kb(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("VmRSS:")[1].split()[0]) if "VmRSS:" in status else None


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
