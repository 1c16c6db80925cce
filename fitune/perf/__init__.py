"""Speed models (pure Python): FLOPs per token, utilisation."""
