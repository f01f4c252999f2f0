"""The machine the plan is made for: copy bandwidths, Adam velocities, matmul rates, memory.

Measured once per machine and cached (``measure.py``), read from a file (``profile.py``), or a
card's shipped by name, measured or derived from published figures (``cards.py``, ``load.py``). The
public face of the machine for the HF layer (``elixir-plan``, ``elixir-env``): the profile, where
it comes from, the host's memory and cores (``host.py``) and the Adam kernels this machine runs
(``kernels/select.py``).
"""

from ..host import host_available, host_total, usable_cores
from ..kernels.select import cpu_kernel_status, gpu_kernel_status
from .cards import REFERENCE
from .load import ENV_HARDWARE, MEASURED, SHIPPED, cache_path, load_hardware, unknown_card
from .measure import measure_hardware
from .profile import UNREADABLE, HardwareProfile, LinkRates

__all__ = [
    "HardwareProfile",
    "LinkRates",
    "UNREADABLE",
    "load_hardware",
    "measure_hardware",
    "cache_path",
    "ENV_HARDWARE",
    "SHIPPED",
    "MEASURED",
    "REFERENCE",
    "unknown_card",
    "host_available",
    "host_total",
    "usable_cores",
    "cpu_kernel_status",
    "gpu_kernel_status",
]
