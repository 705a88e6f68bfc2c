"""Keep the servers a training script launched alive, or say clearly that one died.

`Supervisor(name, server, relaunch)` watches the server's process from a daemon thread. When the
process exits:
- with `relaunch` (a stateless server, such as the retrieval server, started again on the same
  address), it is restarted after a backoff of `backoff_s * 2**k` seconds, at most `max_restarts`
  times; `restarts` counts them for the metrics. Tool calls made while it is down fail, are
  retried by the caller, and are counted as tool failures.
- without `relaunch` (an inference server: a fresh one would serve the initial weights under the
  current policy version, so restarting it silently would corrupt the learning signal), or once
  the restarts are used up, `check()` raises with the exit code and the tail of the server's log.
"""
import threading
import time
from typing import Callable

from lib.launch import log_tail


class Supervisor:
    def __init__(self, name: str, server, relaunch: Callable[[], object] | None = None, *, poll_s: float = 0.5,
                 max_restarts: int = 5, backoff_s: float = 1.0):
        self.name, self.server, self.relaunch = name, server, relaunch
        self.poll_s, self.max_restarts, self.backoff_s = poll_s, max_restarts, backoff_s
        self.restarts = 0
        self.error: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"supervise-{name}", daemon=True)
        self._thread.start()

    def check(self):
        """Raise RuntimeError if the server is down for good."""
        if self.error is not None:
            raise RuntimeError(self.error)

    def stop(self, terminate: bool = True):
        """Stop watching (call before shutting the server down), and terminate the current server."""
        self._stopped.set()
        self._thread.join(timeout=60)
        if terminate:
            self.server.terminate()

    def _watch(self):
        while not self._stopped.wait(self.poll_s):
            code = self.server.process.poll()
            if code is None:
                continue
            if self.relaunch is None or self.restarts >= self.max_restarts:
                self.error = self._died(code, "not restarted" if self.relaunch is None
                                        else f"after {self.restarts} restarts")
                return
            if self._stopped.wait(self.backoff_s * 2 ** self.restarts):
                return
            try:
                self.server = self.relaunch()
            except Exception as e:  # the relaunch itself failed: down for good
                self.error = self._died(code, f"its restart failed: {e}")
                return
            self.restarts += 1
            print(f"[supervise] {self.name} exited with code {code}; restarted at {self.server.address} "
                  f"(restart {self.restarts} of at most {self.max_restarts})", flush=True)

    def _died(self, code: int, what: str) -> str:
        log_path = getattr(self.server, "log_path", None)
        tail = log_tail(log_path, 20)
        return (f"the {self.name} at {self.server.address} (pid {self.server.process.pid}) exited with code {code} "
                f"at {time.strftime('%H:%M:%S')}, {what}; last lines of its log {log_path}:\n{tail}")
