"""Floor 3: local steps with an outer optimizer every H steps (``DiLoCo``)."""
