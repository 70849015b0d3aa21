"""The machine around the job: preemption signals and the local multi-node launcher (the output lock: ``moeshard.checkpoint.OutputLock``)."""
