"""The HF cases (``hf_cases.py``) every test of this folder and its subfolders imports by name."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
