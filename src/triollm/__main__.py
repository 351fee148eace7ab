from __future__ import annotations

from triollm.cli import run

if __name__ == "__main__":  # not when a worker process loads the parent's main module
    run()
