"""The ``shmloader`` command: ``shmloader bench``, ``shmloader doctor`` and
``shmloader make-images``."""

from __future__ import annotations

import sys

_COMMANDS = {
    "bench": "compare this loader with torch DataLoader on synthetic workloads",
    "doctor": "check what breaks loaders on this machine, and say what to do",
    "make-images": "write a synthetic JPEG image folder (DIR --count N; needs Pillow)",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``shmloader <command> [options]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"shmloader: unknown command {argv[0]!r}", file=sys.stderr)
        print("usage: shmloader <command> [options]\n\ncommands:")
        for name, text in _COMMANDS.items():
            print(f"  {name:<12} {text}")
        print("\n`shmloader <command> --help` describes a command's options.")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if argv[0] == "bench":
        from shmloader import bench

        return bench.main(argv[1:])
    if argv[0] == "make-images":
        return _make_images(argv[1:])
    from shmloader import doctor

    return doctor.main(argv[1:])


def _make_images(argv: list[str]) -> int:
    """``shmloader make-images``: the parser lives in :func:`shmloader.vision.synth.main`."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        if not any(a in ("-h", "--help") for a in argv):
            print(
                "shmloader make-images: needs Pillow, which is not installed (pip install pillow; "
                "simplejpeg is optional and makes encoding faster).",
                file=sys.stderr,
            )
            return 2
    from shmloader.vision import synth

    return synth.main(argv)


if __name__ == "__main__":
    sys.exit(main())
