"""TriAttention selection (docs/triattention.md): calibration, mean-phase coefficients, the scorer (CuTe DSL) and
the normalize-and-reduce (Triton), keep sets by ``kvops.topk``, and the float64 reference of the semantics."""

from .calibration import SHIPPED, Calibration, LayerSensitivity, calibration_file, load_calibration, validate_calibration
from .phase import mean_phase
from .rope import rope_parameters
from .select import TriAttentionSelector

__all__ = ["SHIPPED", "Calibration", "LayerSensitivity", "TriAttentionSelector", "calibration_file", "load_calibration", "mean_phase",
           "rope_parameters", "validate_calibration"]
