"""Hooks into other people's training loops. Each module imports its framework; import the one you use:

- `fitune.integrations.hf`: `FituneCallback`, a transformers `TrainerCallback` running fitune's run checks.
"""
