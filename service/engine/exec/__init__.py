"""Running a step: its inputs, the forward on every rank, CUDA graphs, the draft model
and speculation, and what a step computes from prompt rows."""
