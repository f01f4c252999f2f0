"""The machine the plan is made for: copy bandwidths, Adam velocities, matmul rates, memory.

Measured once per machine and cached (``measure.py``), or read from a file (``profile.py``).
"""

from .load import load_hardware
from .profile import HardwareProfile, LinkRates

__all__ = ["HardwareProfile", "LinkRates", "load_hardware"]
