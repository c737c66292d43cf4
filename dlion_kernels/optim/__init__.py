"""Floor 3: ``torch.optim`` front ends."""
