"""What a training step costs, plans that fit a byte budget, and the mechanisms and
measurements those plans use. A pure library: torch and numpy only."""

from memory.blocks import as_blocks
from memory.errors import BudgetError, MemoryPlanError
from memory.sizes import format_bytes, parse_bytes

__all__ = ["BudgetError", "MemoryPlanError", "as_blocks", "format_bytes", "parse_bytes"]
