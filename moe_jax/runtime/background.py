"""Start-up work run on a background thread while the main thread does other work.

`moe-jax train` builds a new run's training data pipeline (TensorFlow/seqio: the preprocessors
traced by ``tf.data``) on a :class:`Background` thread while the main thread compiles the
train step and initialises the state: the XLA compile and the state's program release the
GIL, and the pipeline's first batches are made by ``tf.data`` 's own threads meanwhile.
:meth:`Background.result` hands the value to the main thread, or raises the exception the
work raised there, so an error reads as it would have without the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``work()`` run on a daemon thread named ``what`` from construction on.

    :meth:`result` waits for it and returns its value, or raises what it raised (the same
    exception, its traceback kept, with a note naming ``what``), and marks it ``taken``;
    :meth:`discard` waits for it and hands its value to ``cleanup`` (e.g. to close an
    iterator nobody will read).
    """

    def __init__(self, work: Callable[[], T], what: str):
        self.what = what
        self._value: T | None = None
        self._error: BaseException | None = None
        self._noted = False
        self.taken = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=what, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._value = work()
        except BaseException as err:  # raised again by result(), on the waiting thread
            self._error = err

    @property
    def done(self) -> bool:
        """Whether ``work()`` has finished (returned or raised)."""
        return not self._thread.is_alive()

    def result(self) -> T:
        """``work()``'s value, once it has finished.

        Raises:
          BaseException: the exception ``work()`` raised, as it was.
        """
        self._thread.join()
        self.taken = True
        if self._error is not None:
            if not self._noted:
                self._error.add_note(f"(raised on the background thread {self.what!r})")
                self._noted = True
            raise self._error
        return self._value  # type: ignore[return-value]  # set: work() returned

    def discard(self, cleanup: Callable[[T], object]) -> None:
        """Waits for ``work()`` and passes its value to ``cleanup``; an exception it raised
        is dropped (the caller is already stopping for another reason)."""
        self._thread.join()
        if self._error is None:
            cleanup(self._value)  # type: ignore[arg-type]  # set: work() returned
