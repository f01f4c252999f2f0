"""The console scripts, one module each (``pyproject.toml``'s ``[project.scripts]``): ``plan``
(``elixir-plan``, with ``plan_report`` and ``plan_plot``, which only it uses), ``run`` (``elixir-run``),
``env`` (``elixir-env``) and ``convert`` (``elixir-convert``). Each also runs as ``python -m
elixir_hf.commands.NAME``.
"""
