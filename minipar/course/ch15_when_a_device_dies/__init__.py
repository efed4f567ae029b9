"""Chapter 15: when a device dies — failure rates and the checkpoint interval, asynchronous checkpoints, silent
data corruption caught before the optimizer step, and a run that loses a replica and goes on."""
