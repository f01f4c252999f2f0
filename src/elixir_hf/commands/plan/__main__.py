"""``python -m elixir_hf.commands.plan``: ``elixir-plan``."""

from . import main

raise SystemExit(main())
