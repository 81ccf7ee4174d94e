"""The at-fork hooks: every one of the package's runs through shmloader.system.forks, in the
order its tuples give, and one that raises does not keep the others from running."""

from __future__ import annotations

import ast
import os
import sys

import pytest

import shmloader  # noqa: F401  (imports every module that registers a hook)
from shmloader.system import forks

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_every_owner_registered_in_its_place():
    assert set(forks.registered("before")) == set(forks.BEFORE)
    assert set(forks.registered("after_in_parent")) == set(forks.AFTER_IN_PARENT)
    assert set(forks.registered("after_in_child")) == set(forks.AFTER_IN_CHILD)
    for name in {*forks.BEFORE, *forks.AFTER_IN_PARENT, *forks.AFTER_IN_CHILD}:
        assert name in sys.modules


def test_a_name_without_a_place_is_refused():
    with pytest.raises(ValueError, match="no place"):
        forks.register("elsewhere", after_in_child=lambda: None)


def _fork_and_record(fail: str | None = None) -> tuple[list, list]:
    """Fork once with every hook wrapped to note (phase, name); the hook named ``fail``
    raises instead in the child. Returns what ran in the parent and in the child; the
    hooks are registered back as they were."""
    ran: list[tuple[str, str]] = []
    originals = {phase: forks.registered(phase) for phase in ("before", "after_in_parent", "after_in_child")}
    try:
        for phase, hooks in originals.items():
            for name, hook in hooks.items():

                def noted(phase: str = phase, name: str = name, hook=hook) -> None:
                    ran.append((phase, name))
                    if phase == "after_in_child" and name == fail:
                        raise RuntimeError("a hook that fails")
                    hook()

                forks.register(name, **{phase: noted})
        return ran, _fork_and_read(ran)
    finally:
        for phase, hooks in originals.items():
            for name, hook in hooks.items():
                forks.register(name, **{phase: hook})


def _fork_and_read(ran: list[tuple[str, str]]) -> list:
    """Fork; the child writes ``ran`` as it is there and exits. What the child wrote."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what ran, never return
        try:
            os.close(r)
            os.write(w, repr(ran).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as reader:
        child = ast.literal_eval(reader.read().decode())
    os.waitpid(pid, 0)
    return child


def _expected(after: str, order: tuple[str, ...]) -> list[tuple[str, str]]:
    return [("before", n) for n in forks.BEFORE] + [(after, n) for n in order]


def test_hooks_run_in_the_declared_order():
    parent, child = _fork_and_record()
    assert parent == _expected("after_in_parent", forks.AFTER_IN_PARENT)
    assert child == _expected("after_in_child", forks.AFTER_IN_CHILD)


def test_a_failing_hook_leaves_the_others_running():
    first = forks.AFTER_IN_CHILD[0]
    _, child = _fork_and_record(fail=first)
    assert child == _expected("after_in_child", forks.AFTER_IN_CHILD)
