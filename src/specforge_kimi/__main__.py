"""``python -m specforge_kimi`` == ``specforge-kimi``."""

from specforge_kimi.cli import main

raise SystemExit(main())
