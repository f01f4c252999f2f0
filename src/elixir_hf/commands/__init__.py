"""The console scripts (``pyproject.toml``'s ``[project.scripts]``), each a command line that parses
its arguments and calls into the package: a module per command, ``run`` (``elixir-run``), ``env``
(``elixir-env``) and ``convert`` (``elixir-convert``), and a folder for one of several files, ``plan``
(``elixir-plan``: its parser in ``__init__.py``, the report, the plot, the hardware it plans for and
``--run``). Each also runs as ``python -m elixir_hf.commands.NAME``. Nothing outside this folder
imports it (``tests/test_layers.py``).
"""
