"""Floor 2: the D-Lion protocol on a process group."""
