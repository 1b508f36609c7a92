"""gunicorn's ``gthread`` worker, taking a connection only when it can serve it.

The stock worker accepts connections up to ``worker_connections`` (1,000) and
queues their requests behind its threads. A process whose threads all stream
exports would still accept a worker's heartbeat and make it wait for an export
to end, while another process had threads to spare. This one stops listening
while all its threads are busy: the kernel then hands new connections to a
process that can answer at once, and they wait in the listen backlog only when
every thread of every process is busy.

Everything here runs on the worker's main thread (the accept and completion
callbacks of gunicorn's event loop), so the count needs no lock.
"""

from __future__ import annotations

from gunicorn.workers.gthread import ThreadWorker as StockThreadWorker


class ThreadWorker(StockThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = 0  # requests submitted to the thread pool and not finished

    def enqueue_req(self, conn):
        self.busy += 1
        super().enqueue_req(conn)
        self._listen()

    def finish_request(self, conn, fs):
        self.busy -= 1
        super().finish_request(conn, fs)  # may submit the connection's next request
        self._listen()

    def set_accept_enabled(self, enabled):
        super().set_accept_enabled(enabled and self.busy < self.cfg.threads)

    def _listen(self):
        if self.alive:
            self.set_accept_enabled(self.nr_conns < self.worker_connections)
