"""Run on 2 ranks by ``test_clean_exit.py``: writes the signal this rank gets when its parent exits."""

import sys

from helpers.lifetime import parent_death_signal

print(f"death signal {parent_death_signal()}", file=sys.stderr)
