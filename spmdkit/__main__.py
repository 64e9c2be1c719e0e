"""``python -m spmdkit``: the same command line as the ``spmdkit`` script."""

from spmdkit.cli import main

raise SystemExit(main())
