from __future__ import annotations

import sys

from triollm.cli import main

sys.exit(main())
