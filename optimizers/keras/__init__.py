"""Built-in optimizers in the Keras 3 style, one per file, named after the registry key."""
