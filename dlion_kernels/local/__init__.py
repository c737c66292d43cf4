"""Floor 3: local steps with an outer optimizer every H steps (``DiLoCo``, SPEC §11)."""
