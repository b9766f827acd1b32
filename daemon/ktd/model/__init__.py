"""What a model file is and how it is placed: the GGUF reader, ``ktd inspect``'s report,
perplexity, the hybrid CPU + GPU placement plan and the GPU policy of a load."""
