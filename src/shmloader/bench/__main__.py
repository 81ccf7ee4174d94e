"""``python -m shmloader.bench``: the same as ``shmloader bench``."""

import sys

from shmloader.bench import main

sys.exit(main())
