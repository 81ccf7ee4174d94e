"""Run torch's own DataLoader tests (its ``test/test_dataloader.py``) with ``DataLoader``
bound to ``shmloader.DataLoader``, and report how many pass and fail.

torch's test file is not part of this repository (nor of torch's wheels): take it from
torch's source for the installed version and pass its path::

    python benchmarks/torch_suite.py /path/to/test_dataloader.py [-k EXPR] [-n 2]

The binding is made in every Python process of the run, before torch's test module is
imported: a ``sitecustomize`` module in a temporary directory put first on
``PYTHONPATH`` rebinds ``torch.utils.data.DataLoader`` and
``torch.utils.data.dataloader.DataLoader`` to shmloader's when
``SHMLOADER_TORCH_SUITE=1``. So the tests that run a loader in a child process (spawned
``ErrorTrackingProcess`` targets, ``subprocess`` scripts) load with shmloader too.
``--torch`` runs the same file unbound (torch's own loader: the baseline).

Prints the counts (passed, failed, errors, skipped, xfailed) and every failing test
with the first line of its message; ``--junit PATH`` keeps pytest's XML report.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SITECUSTOMIZE = """\
import os

if os.environ.get("SHMLOADER_TORCH_SUITE") == "1":
    import torch.utils.data
    import torch.utils.data.dataloader

    import shmloader

    torch.utils.data.DataLoader = shmloader.DataLoader
    torch.utils.data.dataloader.DataLoader = shmloader.DataLoader
"""


def main(argv: list[str] | None = None) -> int:
    """Run the suite; returns pytest's exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("test_file", help="torch's test/test_dataloader.py")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("-n", default="2", help="pytest-xdist processes (0: none)")
    parser.add_argument("--timeout", default="600", help="seconds per test")
    parser.add_argument("--torch", action="store_true", help="torch's own DataLoader (no binding)")
    parser.add_argument("--junit", default=None, help="keep pytest's XML report here")
    args = parser.parse_args(argv)

    test_file = os.path.abspath(args.test_file)
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        junit = args.junit or os.path.join(tmp, "report.xml")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (tmp, os.path.dirname(test_file), env.get("PYTHONPATH")) if p
        )
        env["SHMLOADER_TORCH_SUITE"] = "0" if args.torch else "1"
        command = [
            sys.executable,
            "-m",
            "pytest",
            test_file,
            "-c",
            os.devnull,  # not this repository's pytest configuration
            "--rootdir",
            os.path.dirname(test_file),
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfE",
            f"--timeout={args.timeout}",
            f"--junitxml={junit}",
            "-n",
            args.n,
        ]
        if args.k:
            command += ["-k", args.k]
        status = subprocess.call(command, env=env, cwd=os.path.dirname(test_file))
        print(summary(junit, "torch's DataLoader" if args.torch else "shmloader.DataLoader"))
    return status


def summary(junit: str, bound: str) -> str:
    """The counts and the failing tests of pytest's XML report ``junit``."""
    if not os.path.exists(junit):
        return "no report: pytest did not run"
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0}
    failing = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                message = (child.get("message") or "").strip().splitlines()
                failing.append(
                    f"  {outcome[:-1] if outcome == 'errors' else 'failed'}: {name}: "
                    f"{message[0][:160] if message else ''}"
                )
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        counts[outcome] += 1
    line = ", ".join(f"{v} {k}" for k, v in counts.items())
    return f"torch's test_dataloader.py with {bound}: {line}\n" + "\n".join(failing)


if __name__ == "__main__":
    sys.exit(main())
