"""``python -m kvstrata.cli``: the ``kvstrata`` command."""

from . import main

raise SystemExit(main())
