"""Studies: statistics over a study's jobs (`summary`) and its PNG/HTML report (`report`)."""
