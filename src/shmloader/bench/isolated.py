"""A measurement in a process of its own: started in a new session, so that the bench can
end it and everything it started (workers, resource trackers), also on a timeout, an error
or an interrupt, and list what it left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

_REAP_WAIT_S = 3.0  # a session's last processes (spawn's resource tracker) exit this soon


def _session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (the measuring process's, and what it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        # after the command: state, ppid, pgrp, session
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_isolated(module: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``python -m module SPEC_JSON`` in a fresh process of its own session and return
    the JSON object its last line of output holds, or ``{"error": ...}`` saying why there
    is none. The process and anything it started are ended on a timeout, an error or an
    interrupt; processes it left behind when it exited are listed under ``"leaked"`` (and
    ended)."""
    cmd = [sys.executable, "-m", module, json.dumps(spec)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        proc.communicate()
        return {"error": f"the measurement did not finish in {timeout:.0f} s", "leaked": []}
    except BaseException:
        _kill_session(proc.pid)
        proc.wait()
        raise
    deadline = time.monotonic() + _REAP_WAIT_S
    left = _session_pids(proc.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _session_pids(proc.pid)
    if left:
        _kill_session(proc.pid)
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"error": f"the measurement failed: {last[0]}", "leaked": left}
    result = json.loads(out.strip().splitlines()[-1])
    result["leaked"] = left
    return result
