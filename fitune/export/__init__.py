"""Exporting a trained model to other runtimes.

    gguf.py   `export_gguf`: a Hugging Face folder of full weights (Llama, Mistral, Qwen2) as one GGUF file that
              llama.cpp and Ollama run (f16 or q8_0), with its tokenizer and chat template

`fitune export` (fitune/cli/export.py) is the shell over it. Importing this package imports neither torch nor
transformers nor gguf: they are imported inside the functions that need them.
"""
