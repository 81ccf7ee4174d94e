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
    assert set(forks._before) == set(forks.BEFORE)
    assert set(forks._after_in_parent) == set(forks.AFTER_IN_PARENT)
    assert set(forks._after_in_child) == set(forks.AFTER_IN_CHILD)
    for name in {*forks.BEFORE, *forks.AFTER_IN_PARENT, *forks.AFTER_IN_CHILD}:
        assert name in sys.modules


def test_a_name_without_a_place_is_refused():
    with pytest.raises(ValueError, match="no place"):
        forks.register("elsewhere", after_in_child=lambda: None)


def _fork_and_record(monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> tuple[list, list]:
    """Fork once with every hook wrapped to note (phase, name); the hook named ``fail``
    raises instead in the child. Returns what ran in the parent and in the child."""
    ran: list[tuple[str, str]] = []
    for phase, hooks in (
        ("before", forks._before),
        ("after_in_parent", forks._after_in_parent),
        ("after_in_child", forks._after_in_child),
    ):
        for name, hook in list(hooks.items()):

            def noted(phase: str = phase, name: str = name, hook=hook) -> None:
                ran.append((phase, name))
                if phase == "after_in_child" and name == fail:
                    raise RuntimeError("a hook that fails")
                hook()

            monkeypatch.setitem(hooks, name, noted)
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
    return ran, child


def _expected(after: str, order: tuple[str, ...]) -> list[tuple[str, str]]:
    return [("before", n) for n in forks.BEFORE] + [(after, n) for n in order]


def test_hooks_run_in_the_declared_order(monkeypatch):
    parent, child = _fork_and_record(monkeypatch)
    assert parent == _expected("after_in_parent", forks.AFTER_IN_PARENT)
    assert child == _expected("after_in_child", forks.AFTER_IN_CHILD)


def test_a_failing_hook_leaves_the_others_running(monkeypatch):
    first = forks.AFTER_IN_CHILD[0]
    _, child = _fork_and_record(monkeypatch, fail=first)
    assert child == _expected("after_in_child", forks.AFTER_IN_CHILD)
