"""Built-in optimizers in the legacy tf.keras (OptimizerV2) style, one per file, named by registry key."""
