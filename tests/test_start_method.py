"""With JAX imported and no ``multiprocessing_context`` given, workers start from a
forkserver (JAX warns in every forked worker, and a fork of its threads may deadlock),
with one UserWarning saying so and how to choose; a context given explicitly, or no JAX,
keeps torch's default (fork). Real JAX is not needed: a module named ``jax`` in
``sys.modules`` is what the loader looks at. Each case runs in a child process (the
warning is once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

SCRIPT = """
import json, os, sys, types, warnings

class Parents:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getppid()

if __name__ == "__main__":
    if sys.argv[1] == "jax":
        sys.modules["jax"] = types.ModuleType("jax")
    context = None if sys.argv[2] == "none" else sys.argv[2]
    import shmloader

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parents = []
        for _ in range(2):  # two loaders: the warning comes once
            loader = shmloader.DataLoader(
                Parents(), batch_size=2, num_workers=2, multiprocessing_context=context, output="numpy"
            )
            parents += [int(p) for b in loader for p in b]
    print(json.dumps({
        "forked": sorted(set(parents)) == [os.getpid()],
        "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
        "attribute_none": loader.multiprocessing_context is None,
    }))
"""


def _run(tmp_path, jax: bool, context: str) -> dict:
    script = tmp_path / "jax_case.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=SRC)
    done = subprocess.run(
        [sys.executable, str(script), "jax" if jax else "nojax", context],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_with_jax_imported_workers_start_from_a_forkserver_with_one_warning(tmp_path):
    r = _run(tmp_path, jax=True, context="none")
    assert not r["forked"], "the workers' parent is the forkserver, not this process"
    jax_warnings = [w for w in r["warnings"] if "JAX" in w]
    assert len(jax_warnings) == 1, r["warnings"]
    assert "forkserver" in jax_warnings[0] and "multiprocessing_context" in jax_warnings[0]
    assert r["attribute_none"]  # the loader's attribute stays what was given, as torch's


@pytest.mark.parametrize("jax, context", [(True, "fork"), (False, "none")], ids=["jax-fork-given", "no-jax"])
def test_a_given_context_or_no_jax_forks_without_a_warning(tmp_path, jax, context):
    r = _run(tmp_path, jax=jax, context=context)
    assert r["forked"]
    assert not [w for w in r["warnings"] if "JAX" in w], r["warnings"]
