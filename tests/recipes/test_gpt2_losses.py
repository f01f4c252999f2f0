"""``make train``'s losses, pinned to its corpus (``recipes/gpt2/expected_losses.json``): recipes/README.md
quotes the pinned ones (tests/elixir_hf/test_recipe.py runs the recipe's short run against its pin)."""

from __future__ import annotations

import json
import math
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
EXPECTED = json.loads((RECIPES / "gpt2" / "expected_losses.json").read_text())


def test_the_readme_quotes_the_pinned_losses() -> None:
    readme = " ".join((RECIPES / "README.md").read_text().split())  # its lines joined: a quote may wrap
    train = EXPECTED["make_train"]
    evals = train["eval_loss"]
    assert f"falls (about {train['first_loss']:.1f} → {train['last_loss']:.1f})" in readme
    assert f"(`eval_loss` {', '.join(f'{v:.2f}' for v in evals)};" in readme
    first, last = (round(math.exp(v), -1) for v in (evals[0], evals[-1]))
    assert f"perplexity about {first:.0f} → {last:.0f}" in readme
    assert f"Python {EXPECTED['python']}'s corpus" in readme


def test_the_pin_is_one_run() -> None:
    """200 steps: a loss every 10 (the first and last pinned), an evaluation every 50, each lower."""
    evals = EXPECTED["make_train"]["eval_loss"]
    assert len(evals) == 4 and evals == sorted(evals, reverse=True)
    assert len(EXPECTED["short_run"]["loss"]) == 4 and len(EXPECTED["short_run"]["eval_loss"]) == 2
