"""``python -m musacache.demo``: the same as ``musacache demo``."""

from . import main

raise SystemExit(main())
