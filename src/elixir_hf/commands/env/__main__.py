"""``python -m elixir_hf.commands.env``: ``elixir-env``."""

from . import main

raise SystemExit(main())
