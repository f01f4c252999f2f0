"""The machine the plan is made for: copy bandwidths, Adam velocities, matmul rates, memory.

Measured once per machine and cached (``measure.py``), read from a file (``profile.py``), or a
card's shipped by name, measured or derived from published figures (``cards.py``, ``load.py``).
"""

from .load import load_hardware
from .profile import HardwareProfile, LinkRates

__all__ = ["HardwareProfile", "LinkRates", "load_hardware"]
