"""Physical KV compaction: move kept tokens down, in place, in every layer (docs/compaction.md)."""

from .compact import (MODES, ORDERS, CompactionParams, build_compaction_params, check_decisions, compact,
                      compact_layers_, decision_row, decision_rows, stream_rows)
from .pack import pack_move_sources
from .positions import SlotPositions, follow_slot_positions_

__all__ = ["MODES", "ORDERS", "CompactionParams", "SlotPositions", "build_compaction_params", "check_decisions",
           "compact", "compact_layers_", "decision_row", "decision_rows", "follow_slot_positions_", "pack_move_sources",
           "stream_rows"]
