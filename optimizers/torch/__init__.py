"""Built-in optimizers in the PyTorch style, one per file, named after the registry key."""
