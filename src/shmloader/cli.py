"""The ``shmloader`` command: ``shmloader bench`` and ``shmloader doctor``."""

from __future__ import annotations

import sys

_COMMANDS = {
    "bench": "compare this loader with torch DataLoader on synthetic workloads",
    "doctor": "check what breaks loaders on this machine, and say what to do",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``shmloader <command> [options]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"shmloader: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: shmloader <command> [options]\n\ncommands:")
        for name, text in _COMMANDS.items():
            print(f"  {name:<8} {text}")
        print("\n`shmloader <command> --help` describes a command's options.")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if argv[0] == "bench":
        from shmloader import bench

        return bench.main(argv[1:])
    from shmloader import doctor

    return doctor.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
