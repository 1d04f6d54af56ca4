"""``python -m kvstrata``: the same command line as the ``kvstrata`` script."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
