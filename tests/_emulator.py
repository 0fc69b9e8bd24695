"""A test server in a process of its own: started on a free 127.0.0.1 port, its endpoint read
from the line it prints when it listens, stopped by its PID."""

from __future__ import annotations

import os
import re
import subprocess
import threading

__all__ = ["Emulator"]

_STARTUP_SECONDS = 60


class Emulator:
    """A server process; its endpoint read from the line it prints when it listens."""

    def __init__(self, command: list[str], name: str) -> None:
        self.name = name
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"},
        )
        self.endpoint = self._wait()

    def _wait(self) -> str:
        found: list[str] = []
        lines: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                lines.append(line)
                match = re.search(r"listen\w* on (http://127\.0\.0\.1:\d+)", line)
                if match and not found:
                    found.append(match.group(1))

        threading.Thread(target=read, daemon=True).start()  # also drains its output later
        deadline = _STARTUP_SECONDS * 10
        while not found and deadline and self.process.poll() is None:
            threading.Event().wait(0.1)
            deadline -= 1
        if not found:
            self.stop()
            raise RuntimeError(f"{self.name} did not start: {''.join(lines)[-2000:]}")
        return found[0]

    def stop(self) -> None:
        """Stop the process by its PID (terminate, then kill after 10 s)."""
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
