"""Plugins that put the Elixir engine under training frontends (``axolotl.py``: Axolotl's)."""
