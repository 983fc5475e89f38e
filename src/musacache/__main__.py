"""``python -m musacache`` is the ``musacache`` command."""

from .cli import main

raise SystemExit(main())
