"""TriAttention selection (docs/triattention.md): calibration, mean-phase scoring, top-k keep sets.

This session's part: calibration loading and validation, RoPE parameters, and the float64 reference of the
scoring semantics. The GPU scorer (CuTe DSL) and the radix top-k are open work (issue #4).
"""

from .calibration import Calibration, load_calibration
from .rope import rope_parameters

__all__ = ["Calibration", "load_calibration", "rope_parameters"]
