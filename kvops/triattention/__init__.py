"""TriAttention selection (docs/triattention.md): calibration, mean-phase coefficients, and the float64
reference of the scoring semantics. The GPU scorer (CuTe DSL) and the radix top-k are tracked in issue #4."""

from .calibration import Calibration, load_calibration
from .phase import mean_phase
from .rope import rope_parameters

__all__ = ["Calibration", "load_calibration", "mean_phase", "rope_parameters"]
