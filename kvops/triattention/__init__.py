"""TriAttention selection (docs/triattention.md): calibration, mean-phase coefficients, row scores, top-k keep
sets, and the float64 reference of the semantics. The fused CuTe DSL scorer is still to come (issue #4)."""

from .calibration import Calibration, load_calibration
from .phase import mean_phase
from .rope import rope_parameters
from .select import TriAttentionSelector
from .topk import topk

__all__ = ["Calibration", "TriAttentionSelector", "load_calibration", "mean_phase", "rope_parameters", "topk"]
