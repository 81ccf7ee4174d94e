"""The ``shmloader`` command: ``shmloader bench`` runs the benchmark."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``shmloader <command> [options]``."""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"bench": "compare this loader with torch DataLoader on synthetic image batches"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: shmloader <command> [options]\n\ncommands:")
        for name, text in commands.items():
            print(f"  {name:<8} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    from shmloader import bench

    return bench.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
