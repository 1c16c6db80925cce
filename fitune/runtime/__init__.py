"""fitune's runtime: what turns a TrainSetup into real training steps on a device. train, profile, bench (and
the trace engine) are thin users of it; nothing here imports them.

    device      dtype names, pick_device, configure_allocator (before CUDA starts), limit_allocator, release_memory
    layers      find_decoder_layers: the one way to find a causal LM's repeated decoder blocks
    model       build_model (pretrained folder or random init; dtype; attention; NF4), load_tokenizer,
                prepare_model (PEFT LoRA / freeze / fitune's techniques / checkpointing), set_checkpointing
    techniques/ fitune's memory techniques, one module each (chunked loss, offloaded checkpoints, tiled MLP, ...)
    optim       build_optimizer: adamw, adamw8bit, paged_adamw8bit, adafactor, sgd
    step        forward_loss and train_step: the one training step (gradient accumulation, fp16 scaling, clipping)
    oom         is_oom and the out-of-memory post-mortem (`fitune.oom_report`)

Importing this package imports nothing: each module imports torch (and transformers / peft / bitsandbytes) itself,
and its callers import it where they need it.
"""
