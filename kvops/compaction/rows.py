"""The decision layouts: how many keep sets a request has (union, per KV head, per layer and KV head) and which
one a (layer, KV head) keeps. Apart from compact.py so that reference.py can use them without the ops."""

from __future__ import annotations

from .._checks import check_choice, check_int

MODES = ("union", "per_head", "per_layer_perhead")  # decision layouts: a keep set per request, per KV head, or
                                                    # per (layer, KV head)


def decision_rows(mode: str, layers: int, heads: int) -> int:
    """Rows per request of a decision in `mode`: 1, `heads` or `layers * heads`."""
    check_choice("decision_rows", "mode", mode, MODES)
    check_int("decision_rows", "layers", layers, 1)
    check_int("decision_rows", "heads", heads, 1)
    return {"union": 1, "per_head": heads, "per_layer_perhead": layers * heads}[mode]


def decision_row(rows: int, layers: int, heads: int, layer: int, head: int) -> int:
    """The row of a decision with `rows` rows per request that (layer, KV head) keeps: row 0 (union), row `head`
    (per KV head) or row ``layer * heads + head`` (per layer and KV head)."""
    for name, value in (("rows", rows), ("layers", layers), ("heads", heads)):
        check_int("decision_row", name, value, 1)
    check_int("decision_row", "layer", layer, 0, layers - 1)
    check_int("decision_row", "head", head, 0, heads - 1)
    if rows not in (1, heads, layers * heads):
        raise ValueError(f"kept has {rows} rows per request; expected 1 (union), {heads} (one per KV head) or "
                         f"{layers * heads} (one per layer and KV head)")
    return 0 if rows == 1 else head if rows == heads else layer * heads + head
