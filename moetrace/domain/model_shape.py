"""The model-shape values moetrace assumes where a run does not record them, in one place:
DeepSeek-V3's hidden size and MoE intermediate size, FP8 expert weights (one byte each),
BF16 activations. Whoever assumes one says so (a note, ``runs.approximations``)."""
from __future__ import annotations

#: hidden size of DeepSeek-V3 (bytes per dispatched token = hidden x dtype bytes)
DEFAULT_HIDDEN = 7168
#: MoE intermediate size of DeepSeek-V3: an expert is 3 matrices hidden x this
DEFAULT_MOE_INTERMEDIATE = 2048
#: bytes per activation element (BF16)
DEFAULT_DTYPE_BYTES = 2


def default_expert_bytes(hidden: int | None = None) -> int:
    """Bytes of one expert's weights: 3 FP8 matrices hidden x ``DEFAULT_MOE_INTERMEDIATE``."""
    return 3 * (hidden or DEFAULT_HIDDEN) * DEFAULT_MOE_INTERMEDIATE
