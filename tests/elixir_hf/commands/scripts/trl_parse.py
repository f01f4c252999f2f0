"""A TRL script's parsing, no Elixir in it: a strict ``TrlParser`` (unknown keys of the ``--config`` YAML
file refused) over ``DPOConfig``, as trl/scripts/dpo.py builds it; prints what the arguments hold as JSON.
``test_trl_config.py`` runs it through ``elixir-run``."""

import json

from trl import DPOConfig, TrlParser


def main() -> None:
    (args,) = TrlParser((DPOConfig,)).parse_args_and_config(fail_with_unknown_args=True)
    plugin = getattr(args, "elixir_plugin", None)
    report = {
        "class": type(args).__name__,
        "elixir": plugin is not None,
        "offload": plugin.config.offload if plugin is not None else None,
        "beta": args.beta,
    }
    print("PARSED " + json.dumps(report))


if __name__ == "__main__":
    main()
