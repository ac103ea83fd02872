"""Grammar compiles in a process of their own, so that one past its time limit can be stopped.

xgrammar's compile cannot be interrupted; a thread running one holds its core until it
ends (minutes, for some schemas). A ``CompileWorker`` is a child process that reads the
tokenizer's vocabulary once, then compiles one grammar at a time and answers with
xgrammar's serialized form. A compile past its limit is ended by killing the process
(SIGKILL): its CPU is given back at once.

Workers are forked by a zygote: one small process per server process, started with
``subprocess`` (which works from daemonic processes, Hypercorn's workers, where
``multiprocessing`` may not start children, and re-imports no ``__main__``), that
imports xgrammar once (2-3 s: it imports torch) and then forks a worker per request in
milliseconds; the workers share its pages. The zygote ignores SIGCHLD, so a killed
worker is reaped at once. Each process ends when its pipe to this process ends.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, Pipe
from typing import Any

from trillm.engine.structured.spec import GrammarError, GrammarSpec

_PID = struct.Struct("<q")


class WorkerGone(Exception):
    """The compile process ended (killed at the time limit, or it crashed)."""


class _Zygote:
    """The process that forks workers; started on first use, shared by every compiler here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def fork(self, conn: Connection) -> int:
        """A new worker serving ``conn``'s other end; its pid. Blocks (the first call: until
        the zygote has imported xgrammar)."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            assert self._sock is not None
            try:
                socket.send_fds(self._sock, [b"f"], [conn.fileno()])
                answer = self._sock.recv(_PID.size)
            except OSError as exc:
                raise WorkerGone(f"the grammar worker zygote is gone ({exc})") from None
            if len(answer) < _PID.size:
                raise WorkerGone("the grammar worker zygote exited")
            return int(_PID.unpack(answer)[0])

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from trillm.engine.structured.worker import zygote; zygote({theirs.fileno()})"],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._sock = ours

    def stop(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()  # it sees the end and exits
                self._sock = None
            if self._process is not None:
                try:
                    self._process.wait(5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
                self._process = None


_zygote = _Zygote()
atexit.register(_zygote.stop)


class CompileWorker:
    """One compile process; used by one caller at a time (``GrammarCompiler`` hands them out).

    Starting one blocks (milliseconds; the first in this process: the zygote's 2-3 s start).
    Call from a worker thread, never on the event loop."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._conn, theirs = Pipe()
        try:
            self.pid = _zygote.fork(theirs)
        finally:
            theirs.close()
        self._dead = False
        self.generation = 0  # the compiler's, when it was started
        try:
            self._conn.send_bytes(tokenizer_info_json.encode())
            if self._receive() != {"ready": True}:
                raise WorkerGone("the grammar compile worker did not start")
        except BaseException:
            self.kill()
            raise

    def compile(self, spec: GrammarSpec) -> str:
        """xgrammar's serialized compiled grammar of ``spec``; blocks until the worker answers.

        Raises ``GrammarError`` (the grammar's fault) or ``WorkerGone`` (killed meanwhile)."""
        try:
            self._conn.send_bytes(json.dumps([spec.kind, spec.source, spec.thinking]).encode())
        except (OSError, ValueError) as exc:  # a broken pipe, or closed by kill()
            raise WorkerGone(str(exc)) from None
        answer = self._receive()
        if "error" in answer:
            raise GrammarError(answer["error"])
        return str(answer["grammar"])

    def kill(self) -> None:
        """Stop it now (SIGKILL; the zygote reaps it); safe from any thread, idempotent. A
        thread blocked on its answer gets ``WorkerGone`` (its pipe ends)."""
        if not self._dead:
            self._dead = True
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kill it and close our end of its pipe (only once no thread waits on it)."""
        self.kill()
        self._conn.close()

    def _receive(self) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError, ValueError) as exc:
            raise WorkerGone(f"the grammar compile worker exited ({type(exc).__name__})") from None
        return answer


def zygote(fd: int) -> None:
    """The zygote's side: import xgrammar once, then fork a worker for each pipe received."""
    import xgrammar  # noqa: F401  # imported once here, shared by every fork

    import trillm.engine.structured.build  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed workers are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: we end with its pipe
    sock = socket.socket(fileno=fd)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            return
        if not message or not fds:
            return  # the server process ended: so do we (workers end when their pipes do)
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _serve(Connection(fds[0]))
            finally:
                os._exit(0)
        os.close(fds[0])
        sock.sendall(_PID.pack(pid))


def _serve(conn: Connection) -> None:
    """A worker: serve compiles until its pipe ends (the compiler closed it, or this process died)."""
    import xgrammar

    from trillm.engine.structured.build import build

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send_bytes(json.dumps({"ready": True}).encode())
    while True:
        try:
            kind, source, thinking = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            answer = {"grammar": build(compiler, GrammarSpec(kind, source, thinking)).serialize_json()}
        except GrammarError as exc:
            answer = {"error": str(exc)}
        conn.send_bytes(json.dumps(answer).encode())
