"""The training loop, written once over the framework drivers (`jobs.frameworks`)."""
