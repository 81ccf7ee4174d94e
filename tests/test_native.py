"""The C helper through its typed wrapper: atomics on a shared mapping, the death signal."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from shmloader.memory.ring import Ring
from shmloader.system import slots as _slots


def test_state_atomics_on_a_ring():
    ring = Ring.create(4, 128)
    states = ring.states
    assert [states.load(i) for i in range(4)] == [_slots.FREE] * 4
    assert states.cas(1, _slots.FREE, _slots.ASSIGNED)
    assert not states.cas(1, _slots.FREE, _slots.READY), "CAS fails when the state differs"
    assert states.claim(1, _slots.FREE, _slots.ASSIGNED) == 2, "claim skips taken slots"
    states.store(1, _slots.HELD)
    assert states.load(1) == _slots.HELD
    assert states.claim(0, _slots.FREE, _slots.ASSIGNED) == 0
    assert states.claim(0, _slots.FREE, _slots.ASSIGNED) == 3
    assert states.claim(0, _slots.FREE, _slots.ASSIGNED) == -1, "none left"
    ring.close_fd()


def test_states_are_shared_with_a_forked_process():
    ring = Ring.create(2, 128)
    pid = os.fork()
    if pid == 0:  # the child publishes, as a worker does
        ring.states.store(0, _slots.READY)
        os._exit(0)
    os.waitpid(pid, 0)
    assert ring.states.load(0) == _slots.READY
    ring.close_fd()


def test_parent_death_signal_kills_the_child():
    code = (
        "import os, select, signal, sys, time\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    from shmloader.system import slots as _slots\n"
        "    _slots.set_parent_death_signal(signal.SIGKILL)\n"
        "    print(os.getpid(), flush=True)\n"
        "    os.write(w, b'1')\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        # The parent dies once the signal is armed (not after a fixed sleep, which a
        # loaded machine can outrun); the kernel must then SIGKILL the child.
        "select.select([r], [], [], 15)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.stdout.strip(), f"the child printed no pid: {out.stderr}"
    child = int(out.stdout.split()[0])
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        raise AssertionError(f"child {child} outlived its parent")
