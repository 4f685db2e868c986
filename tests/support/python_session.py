"""One Python interpreter fed a page's code blocks in order, as a reader pastes them into
one session: each block runs in the namespace the blocks before it left, so a block may
use only what its page defined above it.

`PythonSession(cwd, env)` starts `python` running this file as a script; `run(source,
name, not_installed)` sends one block and returns once it has run, raising
`AssertionError` with the block's traceback and the session's output when it raised. The
top-level modules in `not_installed` are absent for the block (ModuleNotFoundError,
importlib.util.find_spec None): what the reader's environment lacks at that point of the
page. The session's stdout and stderr go to a log file (printed with a failure); the
replies come back on a pipe of their own, so nothing a block prints can be mistaken for
one.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class PythonSession:
    """A `python` subprocess in `cwd` with `env`, alive until `close()`."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path, timeout: float) -> None:
        self.log = log
        self.timeout = timeout
        reply_read, reply_write = os.pipe()
        with log.open("wb") as out:  # the child writes to its own copy of the file
            self._process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(reply_write)],
                cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, pass_fds=(reply_write,))
        os.close(reply_write)
        self._replies = os.fdopen(reply_read, "r")

    def run(self, source: str, name: str, not_installed: Sequence[str] = ()) -> None:
        """Run one block; AssertionError with its traceback if it raised."""
        assert self._process.stdin is not None
        request = {"source": source, "name": name, "not_installed": list(not_installed)}
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
        except BrokenPipeError:
            raise AssertionError(f"{name}: the session had ended\n{self._output()}") from None
        reply = self._reply(name)
        assert reply["ok"], f"{name} raised:\n{reply['error']}\n--- output\n{self._output()}"

    def _reply(self, name: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{name} did not end in {self.timeout} s\n{self._output()}"
            ready, _, _ = select.select([self._replies], [], [], min(left, 1.0))
            if ready:
                line = self._replies.readline()
                assert line, (f"{name}: the session exited {self._process.wait()}\n"
                              f"{self._output()}")
                reply: dict[str, Any] = json.loads(line)
                return reply

    def _output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """End the session as a reader would (end of input), killing it if it hangs."""
        if self._process.stdin is not None:
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._replies.close()


def _hide(modules: set[str], hidden: set[str]) -> set[str]:
    """Make the top-level `modules` absent and those `hidden` before and not in `modules`
    present again; returns what is hidden now. A name set to None in sys.modules is absent
    as a module not installed is: its import raises ModuleNotFoundError and
    importlib.util.find_spec answers None (which torch.compile asks of optional modules).
    A module already imported stays."""
    for name in hidden - modules:
        del sys.modules[name]
    for name in modules - hidden:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    return {name for name in modules if sys.modules.get(name, ...) is None}


def _serve(reply_fd: int) -> None:
    """The child's side: exec each block read from stdin in one namespace, as `__main__`."""
    sys.path[0] = ""  # as in an interactive session: the current folder first
    hidden: set[str] = set()
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    replies = os.fdopen(reply_fd, "w")
    for line in sys.stdin:
        request = json.loads(line)
        hidden = _hide(set(request["not_installed"]), hidden)
        try:
            exec(compile(request["source"], request["name"], "exec"), namespace)
            reply = {"ok": True}
        except BaseException as error:  # a block's SystemExit is its failure too
            # from the block's own frame on: this loop's frame says nothing of the block
            assert error.__traceback__ is not None
            text = "".join(traceback.format_exception(type(error), error,
                                                      error.__traceback__.tb_next))
            top = (getattr(error, "name", None) or "").partition(".")[0]
            if isinstance(error, ModuleNotFoundError) and top in hidden:
                text += f"({top} is not installed by the page's steps above)\n"
            reply = {"ok": False, "error": text}
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
