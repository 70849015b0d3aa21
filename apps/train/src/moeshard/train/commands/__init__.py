"""The commands besides training: ``bench``, ``plan``, ``export-hf`` (``moeshard-train <command>``)."""
