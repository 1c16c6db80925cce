"""fitune's own training runner: data (`data`), configuration, the loop and checkpoints. Needs torch and transformers;
nothing here is imported by the estimator core."""
