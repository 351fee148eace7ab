from __future__ import annotations

import sys

from triollm.cli import main

if __name__ == "__main__":  # not when a worker process loads the parent's main module
    sys.exit(main())
