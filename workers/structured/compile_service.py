"""Grammar compilation off the worker's step loop: a thread pool, a cache by spec, a timeout.

The scheduler sends CompileGrammar before it schedules a structured request; the worker hands it
here and goes back to its steps. When the compile ends (or its time runs out) `on_ready` is
called once, from a pool or timer thread, with None or the error to show the client. Identical
specs share one compile, in flight or cached. When the request is admitted, `take` gives its
compiled grammar (waiting for it on a rank whose compile is slower than rank 0's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from deepinfer.engine.protocol import GrammarSpec

CACHE_ENTRIES = 256  # compiled grammars kept (xgrammar's are tens to hundreds of KB each)


class GrammarCompileService:
    def __init__(self, make_backend: Callable[[], object], timeout_s: float,
                 threads: int = 1) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        # The backend (xgrammar, the tokenizer's vocabulary) loads in the pool, once.
        self._backend: Future = self._pool.submit(make_backend)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._requests: dict[str, Future] = {}
        self._lock = threading.Lock()

    @property
    def backend(self):
        return self._backend.result()

    def _compiled(self, spec: GrammarSpec) -> Future:
        key = spec.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(lambda: self.backend.compile(spec))
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def submit(self, request_id: str, spec: GrammarSpec,
               on_ready: Callable[[str, str | None], None]) -> None:
        """Start compiling `spec` for a request; `on_ready(request_id, error)` follows once."""
        future = self._compiled(spec)
        self._requests[request_id] = future
        answered = threading.Event()
        lock = threading.Lock()

        def answer(error: str | None) -> None:
            with lock:
                if answered.is_set():
                    return
                answered.set()
            timer.cancel()
            on_ready(request_id, error)

        def done(f: Future) -> None:
            exc = f.exception()
            answer(None if exc is None else str(exc) if isinstance(exc, ValueError)
                   else f"grammar compilation failed: {type(exc).__name__}: {exc}")

        timer = threading.Timer(self.timeout_s, answer, args=(
            f"grammar compilation took longer than {self.timeout_s:g} s",))
        timer.daemon = True
        timer.start()
        future.add_done_callback(done)

    def take(self, request_id: str, spec: GrammarSpec):
        """The request's compiled grammar (compiled now if it was never submitted here)."""
        future = self._requests.pop(request_id, None) or self._compiled(spec)
        return future.result()

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
