"""``python -m autopar``: the ``autopar`` command (``autopar.cli``, its commands in ``autopar.commands``)."""

from autopar.cli import main

raise SystemExit(main())
