"""Physical KV compaction: move kept tokens down, in place, in every layer (docs/compaction.md)."""

from .compact import (CompactionParams, build_compaction_params, check_decisions, compact, compact_layers_,
                      stream_rows)
from .pack import pack_move_sources

__all__ = ["CompactionParams", "build_compaction_params", "check_decisions", "compact", "compact_layers_",
           "pack_move_sources", "stream_rows"]
