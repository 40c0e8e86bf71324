"""The engine proper: the step (schedule, run, postprocess), its assembly from settings,
the checks a request passes, and what it counts."""
