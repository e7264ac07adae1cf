"""Step runners: one forward of the step contract on a runtime (ORT, torch)."""
