"""What a run measures and reports: metrics, tracking sinks, profiling, communication (estimated and counted)."""
