"""Using a trained model: load a run folder, chat with it, generate, merge the adapter, evaluate.

    load.py      `describe_folder` (pure: what a folder holds and what would load) and `load_run` (model, tokenizer,
                 info) for a fitune run folder, a plain Hugging Face model folder or a PEFT adapter folder
    generate.py  prompts through the chat template, batched greedy / sampled generation, a chat session
    merge.py     `merge_run`: the adapter merged into the base weights, written as safetensors shards
    evaluate.py  loss and perplexity on a data file with the labels `fitune train` trains on; the lm-eval command

`fitune chat`, `generate`, `merge` and `eval` (fitune/cli/) are thin shells over these. Importing this package
imports neither torch nor transformers: they are imported inside the functions that need them.
"""
