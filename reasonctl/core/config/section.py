"""What every config section builds on: strict validation, and the device pattern that
several sections check."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

STRICT = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)
"""No unknown keys, no NaN or infinity, no coercion (``true`` is not a number, ``"5"`` not an
integer): values come typed from TOML, and ``--set`` / environment values are parsed as TOML
literals before validation."""
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")


class Section(BaseModel):
    """Base of every config section: unknown keys, NaN and infinity are errors."""

    model_config = STRICT
