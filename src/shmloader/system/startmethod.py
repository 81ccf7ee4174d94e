"""How workers start where the loader was given no ``multiprocessing_context``.

As torch's loader: from multiprocessing's default context (``fork`` on Linux before
Python 3.14), except with JAX imported. JAX runs threads, and a process forked from a
multithreaded one may deadlock: JAX warns in every forked worker ("os.fork() was called
... JAX is multithreaded"). With ``jax`` in ``sys.modules``, no context given and a
default of ``fork``, workers start from a ``forkserver`` instead (the dataset reaches
them pickled, as with spawn), with one ``UserWarning`` per process saying so and how to
choose: pass ``multiprocessing_context`` explicitly (``"fork"`` keeps fork and JAX's
warnings).
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from typing import Any

from shmloader.errors import user_stacklevel

_warned = [False]  # the switch was announced in this process


def worker_context(given: Any) -> Any:
    """The multiprocessing context workers start from: ``given`` (a context, or a start
    method's name), else the default one, or ``forkserver`` where JAX is imported and
    the default is ``fork`` (see the module)."""
    if given is not None and not isinstance(given, str):
        return given
    jax_forks = given is None and "jax" in sys.modules and _default_method() == "fork"
    if jax_forks and "forkserver" in multiprocessing.get_all_start_methods():
        _announce()
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context(given)


def _default_method() -> str:
    return (
        multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_context().get_start_method()
    )


def _announce() -> None:
    if _warned[0]:
        return
    _warned[0] = True
    warnings.warn(
        "JAX is imported and the DataLoader was given no multiprocessing_context: its workers "
        "start from a 'forkserver' instead of by fork (forking a process in which JAX runs "
        "threads may deadlock, and JAX warns in every forked worker); the dataset reaches them "
        "pickled. Pass multiprocessing_context='forkserver' to choose it and silence this "
        "warning, or multiprocessing_context='fork' to fork anyway.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
