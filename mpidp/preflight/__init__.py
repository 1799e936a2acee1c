"""Pre-flight: what a model will do on bands before a run (validate, audit, explain, plan)."""
