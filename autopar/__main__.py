"""``python -m autopar``: the ``autopar`` command (``autopar.cli``)."""

from autopar.cli import main

raise SystemExit(main())
